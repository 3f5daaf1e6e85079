------------------------- MODULE MCStagingReleaseHeld -------------------------
(***************************************************************************)
(* Broken on purpose: the consumer releases the page when it is done       *)
(* reading, without waiting for the pool writes that still read it.  The   *)
(* next save may then claim and overwrite rows a write has not landed yet. *)
(* TLC must report PageExclusive violated.                                 *)
(***************************************************************************)
EXTENDS Staging

done_reading_ignores_writes(p) ==
    /\ reading[p]
    /\ reading' = [reading EXCEPT ![p] = FALSE]
    /\ due' = [due EXCEPT ![p] = TRUE]
    /\ UNCHANGED <<page, at, unconsumed, writes, delivered, nextId, engine, mine,
                   attempts, bad, gaveUp>>
=============================================================================
