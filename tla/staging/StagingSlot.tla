----------------------------- MODULE StagingSlot -----------------------------
(***************************************************************************)
(* The staging-slot machine of one page, as the TLA+ side states it.       *)
(*                                                                         *)
(* omni_cache/runtime/states.py STAGING_TABLE is the code's copy of this machine.  *)
(* They are kept equal by tests, not by copying: tests/formal/test_tla_conformance *)
(* compares (1) the action graph TLC explores for Staging.tla with one     *)
(* page (-dump dot,actionlabels) and (2) SlotEdges itself with             *)
(* STAGING_TABLE.edges().  Trace validation (omni_cache/verify/traces.py)   *)
(* checks recorded runtime traces against SlotEdges.                       *)
(***************************************************************************)

SlotStates == {"free", "claimed", "saved", "materialized"}

SlotTriggers == {"claim", "abort", "save", "consume", "release"}

\* <<source, trigger, destination>>: the only moves a staging slot makes.
SlotEdges ==
    { <<"free",         "claim",   "claimed">>,
      <<"claimed",      "abort",   "free">>,
      <<"claimed",      "save",    "saved">>,
      <<"saved",        "consume", "materialized">>,
      <<"materialized", "release", "free">> }

\* Trigger t may fire in state s and leads to state d.
Fires(s, t, d) == <<s, t, d>> \in SlotEdges

\* The destination of trigger t from state s (only meaningful if CanFire).
CanFire(s, t) == \E d \in SlotStates : Fires(s, t, d)
After(s, t) == CHOOSE d \in SlotStates : Fires(s, t, d)
=============================================================================
