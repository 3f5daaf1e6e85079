------------------------ MODULE MCTenancyDraftNoVacate ------------------------
(* Broken variant: the verdict cuts the rejected rows from the step's      *)
(* output but does not vacate their KV slot, so a hit planned before the   *)
(* request rewrites the slot reads the rejected draft's row.               *)
EXTENDS TenancyDraft

VacateNever(a) == FALSE
=============================================================================
