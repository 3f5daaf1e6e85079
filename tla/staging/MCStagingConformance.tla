------------------------ MODULE MCStagingConformance ------------------------
(***************************************************************************)
(* One page, for the conformance check (tests/formal/test_tla_conformance.py and  *)
(* `omni-cache verify`): TLC runs this with -dump dot,actionlabels, and    *)
(* the action graph of the page (edges state -action-> state) must equal   *)
(* omni_cache/runtime/states.py STAGING_TABLE.edges().  The ASSUME prints          *)
(* SlotEdges so that the table the spec states is compared as well.        *)
(***************************************************************************)
EXTENDS Staging, TLC

ASSUME PrintT(<<"SlotEdges", SlotEdges>>)
=============================================================================
