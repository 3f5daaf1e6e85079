-------------------- MODULE MCWritesCopyAfterFailure --------------------
(* Broken variant: the committer starts a copy after the manager failed. *)
EXTENDS MCWrites

start_copy_ignoring_failure(i) ==
    /\ busy = 0
    /\ queue # <<>>
    /\ Head(queue) = i
    /\ WMove(i, "start_copy")
    /\ queue' = Tail(queue)
    /\ busy' = i
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>
=============================================================================
