-------------------- MODULE MCWritesDropOnFinish --------------------
(* Broken variant: an ended admission's open writes are never enqueued. *)
EXTENDS MCWrites

EndAdmissionDropping(a) ==
    /\ ended' = ended \cup {a}
    /\ UNCHANGED <<w, queue>>
=============================================================================
