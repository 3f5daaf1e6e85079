------------------------- MODULE MCWritesConformance -------------------------
(***************************************************************************)
(* One write, for the conformance check: TLC runs this with                *)
(* -dump dot,actionlabels, and the action graph of the write must equal    *)
(* omni_cache/runtime/states.py WRITE_TABLE.edges().  The ASSUME prints WriteEdges *)
(* so that the table the spec states is compared as well.                  *)
(***************************************************************************)
EXTENDS MCWrites, TLC

ASSUME PrintT(<<"WriteEdges", WriteEdges>>)
=============================================================================
