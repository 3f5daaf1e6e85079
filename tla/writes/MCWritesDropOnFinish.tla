------------------------ MODULE MCWritesDropOnFinish ------------------------
(***************************************************************************)
(* Broken on purpose: the open (deferred) writes of a request are looked   *)
(* up only while the request is alive, so once it finished or aborted     *)
(* nobody enqueues them (I9 broken).  They stay pending until an unrelated *)
(* error fails them, if ever: TLC must report AbortsLand violated.         *)
(***************************************************************************)
EXTENDS Writes

enqueue_live_only(i) ==
    /\ ~finished[ReqOf(i)]
    /\ WMove(i, "enqueue")
    /\ queue' = Append(queue, i)
    /\ UNCHANGED <<deferred, busy, finished, failure, errors>>
=============================================================================
