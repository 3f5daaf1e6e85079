----------------------- MODULE MCTenancyDraftVacateAll -----------------------
(* Broken variant: the verdict vacates the slot whatever it decides, so a  *)
(* hit on an accepted draft's row is refused ("is not readable").          *)
EXTENDS TenancyDraft

VacateAlways(a) == TRUE
=============================================================================
