------------------- MODULE MCWritesFailSparesPending -------------------
(* Broken variant: once the manager has failed, only queued writes are   *)
(* failed; a pending (deferred) write whose request can no longer finish  *)
(* stays open for good (I8: FailureEndsAll).                             *)
EXTENDS MCWrites

fail_spares_pending(i) ==
    /\ Registered(i)
    /\ w[i] \in LiveStates
    /\ IF failure
          THEN /\ w[i] \in {"queued"}
               /\ WMove(i, "fail")
               /\ queue' = Remove(queue, i)
               /\ UNCHANGED <<busy, failure, errors>>
          ELSE /\ errors < MaxErrors
               /\ w' = [j \in Writes |-> IF j = i \/ j \in Range(queue) THEN WAfter(w[j], "fail") ELSE w[j]]
               /\ errors' = errors + 1
               /\ failure' = TRUE
               /\ queue' = <<>>
               /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals>>
    /\ UNCHANGED <<shut, stopped>>
=============================================================================
