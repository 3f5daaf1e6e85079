---------------------------- MODULE MCTenancyDraft ----------------------------
(***************************************************************************)
(* Model-checking harness for TenancyDraft.  MCTenancyDraft.cfg: 3 writes  *)
(* to one KV slot over 2 tenancies, 2 delayed readers (the CI tier).       *)
(***************************************************************************)
EXTENDS TenancyDraft
=============================================================================
