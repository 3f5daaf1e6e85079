------------------------- MODULE MCStagingLostRelease -------------------------
(***************************************************************************)
(* Broken on purpose: only the consumer's done_reading releases a page; a  *)
(* pool write that lands after the consumer finished never does.  Such a   *)
(* page stays "materialized" for good; once the engine's saves run out the *)
(* system is stuck short of its end.  TLC must report a deadlock.          *)
(***************************************************************************)
EXTENDS Staging

land_without_release(i) ==
    /\ i \in writes
    /\ writes' = writes \ {i}
    /\ UNCHANGED <<page, reading, due, at, unconsumed, delivered, nextId, engine,
                   mine, attempts, bad, gaveUp>>
=============================================================================
