-------------------- MODULE MCTenancyDropLate --------------------
(* Broken variant: a late older write is dropped, though a planned read needs its rows. *)
EXTENDS Tenancy

DropLate(s, v, K) == {}
=============================================================================
