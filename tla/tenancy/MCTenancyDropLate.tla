--------------------------- MODULE MCTenancyDropLate ---------------------------
(***************************************************************************)
(* Broken on purpose: an older write that lands after a newer tenant's     *)
(* (deferred writes reordered by the queue's front pushes) is skipped      *)
(* without keeping its rows for the planned read that needs them.  The     *)
(* read then raises "is not readable" although its rows were written: TLC  *)
(* must report HitServed violated.  (The bug the threaded stateful test    *)
(* found; the fix is SlotTenancy._preserve_late_locked.)                   *)
(***************************************************************************)
EXTENDS Tenancy

DropLate(s, v) == {}
=============================================================================
