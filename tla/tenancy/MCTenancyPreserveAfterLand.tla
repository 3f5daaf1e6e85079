--------------------- MODULE MCTenancyPreserveAfterLand ---------------------
(***************************************************************************)
(* Broken on purpose: the rows a planned read needs are "preserved" after  *)
(* the newer tenant's write landed, so the copy set aside under the old    *)
(* version holds the newer tenant's rows.  TLC must report NoStaleTenant   *)
(* violated.                                                               *)
(***************************************************************************)
EXTENDS Tenancy

PreservedTooLate(s, old, new) ==
    IF old # Absent /\ old # new /\ Needed(s, old) /\ KeptFor(s, old) = {}
       THEN {[slot |-> s, ver |-> old, rows |-> new]}
       ELSE {}
=============================================================================
