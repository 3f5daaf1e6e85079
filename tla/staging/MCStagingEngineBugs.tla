-------------------------- MODULE MCStagingEngineBugs --------------------------
(***************************************************************************)
(* Broken on purpose: engine and caller bugs that change only bookkeeping  *)
(* no action reads, each caught by the invariant or property stating it.   *)
(* One cfg per bug substitutes one operator:                               *)
(*  - MCStagingWaitWhenFree.cfg: a save waits although a page is free      *)
(*    (WaitOnlyWhenFull);                                                  *)
(*  - MCStagingLostAttempt.cfg: a save attempt vanishes: counted, but it   *)
(*    neither waits nor claims (AttemptsAccounted);                        *)
(*  - MCStagingAbortKeepsPage.cfg: an aborted save still names its page as *)
(*    the engine's (OnePagePerSave);                                       *)
(*  - MCStagingRejectValid.cfg: the pool rejects a consume of a consumable *)
(*    id (RejectOnlyUnknown);                                              *)
(*  - MCStagingAbortStuck.cfg: with every copy failing, a failed save      *)
(*    never gives its page back (AllSavesEnd, under FailingCopiesSpec).    *)
(***************************************************************************)
EXTENDS MCStaging

wait_when_free ==
    /\ engine = "idle"
    /\ attempts < MaxSaves
    /\ engine' = "waiting"
    /\ attempts' = attempts + 1
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   mine, bad, gaveUp>>

wait_lost ==
    /\ engine = "idle"
    /\ attempts < MaxSaves
    /\ NoFreePage
    /\ attempts' = attempts + 1
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   engine, mine, bad, gaveUp>>

abort_keeps_page ==
    /\ engine = "claimed"
    /\ Move(mine, "abort")
    /\ engine' = "idle"
    /\ gaveUp' = gaveUp + 1
    /\ UNCHANGED <<reading, due, at, unconsumed, writes, delivered, nextId,
                   mine, attempts, bad>>

reject_valid(i) ==
    /\ Len(bad) < MaxBad
    /\ bad' = Append(bad, i)
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   engine, mine, attempts, gaveUp>>

\* The failed save retries forever and never gives its page back (a step
\* that changes nothing, so TLC sees no deadlock: the property must catch it).
abort_stuck == engine = "claimed" /\ UNCHANGED vars
================================================================================
