------------------------ MODULE MCWritesShutdownBugs ------------------------
(***************************************************************************)
(* Broken on purpose, one bug per cfg, each caught by ShutdownDrains       *)
(* (contract 4.6: no write is left queued without a committer):            *)
(*  - MCWritesSaveAfterShutdown.cfg: save_outputs does not refuse a save   *)
(*    once shutdown began, so a save after the committer stopped registers *)
(*    and queues a write nobody will ever copy;                            *)
(*  - MCWritesStopEarly.cfg: shutdown stops the committer without waiting  *)
(*    for the saves in progress, so a save that had claimed its page       *)
(*    pushes its write after the committer stopped.                        *)
(***************************************************************************)
EXTENDS MCWrites

register_after_shutdown(i) ==
    /\ ~failure
    /\ ~Registered(i)
    /\ gen[ReqOf(i)] > 0
    /\ <<ReqOf(i), gen[ReqOf(i)]>> \notin ended
    /\ own' = [own EXCEPT ![i] = <<ReqOf(i), gen[ReqOf(i)]>>]
    /\ deferred' \in {[deferred EXCEPT ![i] = d] : d \in BOOLEAN}
    /\ UNCHANGED <<w, queue, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

stop_before_saves_end ==
    /\ shut
    /\ ~stopped
    /\ queue = <<>>
    /\ busy = 0
    /\ stopped' = TRUE
    /\ UNCHANGED <<w, own, deferred, queue, busy, gen, ended, lastSeq, applied, admits, terminals,
                   failure, errors, shut>>
=============================================================================
