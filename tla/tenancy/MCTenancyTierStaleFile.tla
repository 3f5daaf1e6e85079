------------------------ MODULE MCTenancyTierStaleFile ------------------------
(* Broken variant: a put and a spill that fails leave the older spilled    *)
(* file of the hash in place, so after the newer version is lost (disk     *)
(* full) the tier serves the older version from disk.                      *)
EXTENDS TenancyTier

KeepStaleFile(c) == disk[c]
=============================================================================
