------------------------- MODULE MCTenancyNoPreserve -------------------------
(***************************************************************************)
(* Broken on purpose: a slot is reused without preserving the rows a       *)
(* planned read needs.  The version check still keeps the reader from     *)
(* returning the newer tenant's rows, so the read raises "is not readable" *)
(* although its rows were written: TLC must report HitServed violated.     *)
(***************************************************************************)
EXTENDS Tenancy

PreserveNothing(s, old, new) == {}
=============================================================================
