-------------------------- MODULE MCTenancyTierStale --------------------------
(* Broken variant: a store reads the pool row without the tenancy check,   *)
(* so a slot whose new tenant has not written yet stores the previous      *)
(* tenant's (stale) rows under the new content's hash.                     *)
EXTENDS TenancyTier

StoreStaleRows(s) == pool[s]
=============================================================================
