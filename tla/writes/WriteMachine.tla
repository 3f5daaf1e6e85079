---------------------------- MODULE WriteMachine ----------------------------
(***************************************************************************)
(* The pool-write lifecycle, as the TLA+ side states it.                   *)
(*                                                                         *)
(* omni_cache/runtime/states.py WRITE_TABLE is the code's copy; tests compare the  *)
(* action graph TLC explores for Writes.tla with one write, and WriteEdges *)
(* itself, with WRITE_TABLE.edges().                                       *)
(***************************************************************************)

WriteStates == {"pending", "queued", "copying", "host_ready", "written", "failed"}
LiveStates == {"pending", "queued", "copying", "host_ready"}
EndStates == {"written", "failed"}

WriteEdges ==
    { <<"pending",    "enqueue",     "queued">>,
      <<"queued",     "start_copy",  "copying">>,
      <<"copying",    "finish_copy", "host_ready">>,
      <<"host_ready", "commit",      "written">> }
    \cup { <<s, "fail", "failed">> : s \in LiveStates }

WFires(s, t, d) == <<s, t, d>> \in WriteEdges
WCanFire(s, t) == \E d \in WriteStates : WFires(s, t, d)
\* Total: a trigger fired off the edge set gives NoEdge, not a write state,
\* so a spec that fires one breaks its TypeOK (an invariant violation, not
\* a TLC error on an empty CHOOSE).
NoEdge == "no_edge"
WAfter(s, t) == IF WCanFire(s, t) THEN CHOOSE d \in WriteStates : WFires(s, t, d) ELSE NoEdge
=============================================================================
