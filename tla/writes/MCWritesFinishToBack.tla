-------------------- MODULE MCWritesFinishToBack --------------------
(* Broken variant: an ended admission's writes go to the back of the queue. *)
EXTENDS MCWrites

EndAdmissionToBack(a) ==
    LET open == {i \in Writes : own[i] = a /\ w[i] = "pending"}
    IN /\ ended' = ended \cup {a}
       /\ w' = [i \in Writes |-> IF i \in open THEN WAfter(w[i], "enqueue") ELSE w[i]]
       /\ queue' = queue \o SeqOf(open)
=============================================================================
