---------------------------- MODULE MCTenancyDraft ----------------------------
(***************************************************************************)
(* Model-checking harness for TenancyDraft.  MCTenancyDraft.cfg: 4 writes  *)
(* to one KV slot over 2 tenancies, 2 delayed readers (the CI tier).       *)
(***************************************************************************)
EXTENDS TenancyDraft
=============================================================================
