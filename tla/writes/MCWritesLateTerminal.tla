-------------------- MODULE MCWritesLateTerminal --------------------
(* Broken variant: a late FINISHED of an old admission ends the new one. *)
EXTENDS MCWrites

finish_ownerless(r, g, seq) ==
    /\ ~failure
    /\ seq = lastSeq + 1
    /\ g \in 1..gen[r]
    /\ lastSeq' = seq
    /\ applied' = applied \cup {seq}
    /\ terminals' = terminals \cup {<<r, g>>}
    /\ IF <<r, gen[r]>> \notin ended THEN EndAdmission(<<r, gen[r]>>) ELSE UNCHANGED <<w, ended, queue>>
    /\ UNCHANGED <<own, deferred, busy, gen, admits, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>
=============================================================================
