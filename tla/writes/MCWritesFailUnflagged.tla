-------------------- MODULE MCWritesFailUnflagged --------------------
(* Broken variant: a write fails but the manager's failure is not set. *)
EXTENDS MCWrites

fail_unflagged(i) ==
    /\ errors < MaxErrors
    /\ Registered(i)
    /\ w[i] \in LiveStates
    /\ WMove(i, "fail")
    /\ errors' = errors + 1
    /\ queue' = Remove(queue, i)
    /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals, failure>>
    /\ UNCHANGED <<shut, stopped>>
=============================================================================
