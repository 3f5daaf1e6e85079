------------------------------- MODULE MCWrites -------------------------------
(***************************************************************************)
(* Model-checking harness for Writes.  Constants live in the .cfg files    *)
(* (MCWrites.cfg: 2 writes of 2 requests, one possible error); enlarge     *)
(* them there, or pass another cfg with `omni-cache verify --cfg`.         *)
(***************************************************************************)
EXTENDS Writes
=============================================================================
