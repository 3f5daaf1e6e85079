------------------------------ MODULE MCTenancy ------------------------------
(***************************************************************************)
(* Model-checking harness for Tenancy.  Constants live in the .cfg files   *)
(* (MCTenancy.cfg: 1 KV slot, 3 tenants, 2 delayed readers; slots never    *)
(* interact, so one slot shows every interleaving that matters).  Enlarge  *)
(* them there, or pass another cfg with `omni-cache verify --cfg`.         *)
(***************************************************************************)
EXTENDS Tenancy
=============================================================================
