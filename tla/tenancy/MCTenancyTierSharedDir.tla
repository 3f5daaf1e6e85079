------------------------ MODULE MCTenancyTierSharedDir ------------------------
(* Broken variant: a tier reads the shared directory, not its own          *)
(* namespace, so it serves rows another tier (engine, restart) spilled     *)
(* under the same hash.                                                    *)
EXTENDS TenancyTier

ReadShared(c) == shared[c]
=============================================================================
