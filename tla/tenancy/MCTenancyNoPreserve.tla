-------------------- MODULE MCTenancyNoPreserve --------------------
(* Broken variant: rows a planned read needs are not preserved before reuse. *)
EXTENDS Tenancy

PreserveNothing(s, old, new) == {}
=============================================================================
