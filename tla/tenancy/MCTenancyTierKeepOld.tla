------------------------- MODULE MCTenancyTierKeepOld -------------------------
(* Broken variant: a load the tier cannot serve leaves the slot's previous *)
(* tenant's rows readable (no vacate): the hit is served another content. *)
EXTENDS TenancyTier

MissKeepsOldRows(s) == ver[s] + 1
=============================================================================
