---------------------------- MODULE MCTenancyTier ----------------------------
(***************************************************************************)
(* Model-checking harness for TenancyTier.  MCTenancyTier.cfg: 2 KV slots, *)
(* 2 contents, 2 tenants per slot, a 1-entry tier (the CI tier);          *)
(* MCTenancyTierNightly.cfg: 3 tenants per slot.                          *)
(***************************************************************************)
EXTENDS TenancyTier
=============================================================================
