------------------------------- MODULE MCWrites -------------------------------
(***************************************************************************)
(* Model-checking harness for Writes.  Constants live in the .cfg files    *)
(* (MCWrites.cfg: 2 writes of one request id admitted twice -- a REPLACED  *)
(* reuse --, 4 scheduler steps, one possible error; MCWritesNightly.cfg: 3 *)
(* writes, two of them of request 1).  Enlarge them there, or pass another *)
(* cfg with `omni-cache verify --cfg`.                                     *)
(***************************************************************************)
EXTENDS Writes

\* Write i belongs to request id ((i - 1) % NumReqs) + 1.
MCReqOf(i) == ((i - 1) % NumReqs) + 1
=============================================================================
