------------------------- MODULE MCTenancyTierOldSlot -------------------------
(* Broken variant: a load restores the tier's rows into the slot they were *)
(* stored from, not into the new slot the connector loaded.               *)
EXTENDS TenancyTier

RestoreIntoOldSlot(s, c) == IF from[c] = 0 THEN s ELSE from[c]
=============================================================================
