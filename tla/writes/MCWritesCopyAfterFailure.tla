---------------------- MODULE MCWritesCopyAfterFailure ----------------------
(***************************************************************************)
(* Broken on purpose: the committer does not check the sticky failure and  *)
(* keeps copying queued writes after the manager failed.  TLC must report *)
(* the action property StickyFailure violated.                             *)
(***************************************************************************)
EXTENDS Writes

start_copy_ignoring_failure(i) ==
    /\ busy = 0
    /\ queue # <<>>
    /\ Head(queue) = i
    /\ WMove(i, "start_copy")
    /\ queue' = Tail(queue)
    /\ busy' = i
    /\ UNCHANGED <<deferred, finished, failure, errors>>
=============================================================================
