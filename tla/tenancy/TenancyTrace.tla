----------------------------- MODULE TenancyTrace -----------------------------
(***************************************************************************)
(* Trace validation of the KV-slot tenancy against the real Tenancy spec   *)
(* (the style of StagingTrace and WritesTrace): every logged runtime event *)
(* is mapped to the Tenancy action it performs, the spec's guards must     *)
(* allow it, what the runtime observed must equal the spec's result after  *)
(* the step, and TLC checks Tenancy's invariants along the trace           *)
(* (NeverSilentMiss I6, NoStaleTenant and HitServed I7 against the ghost   *)
(* history, NewestLanded, HitOwned, KeptNeeded, WritesCarryKeys).          *)
(*                                                                         *)
(* The generated module TenancyTraceData (omni_cache/verify/               *)
(* tenancy_trace.py) defines Trace, a sequence of per-slot records         *)
(* [ev, slot, ver, keys, r, key, got]:                                     *)
(*   register  tenant ver of slot registers a write of keys (a new tenant: *)
(*             reuse(slot) first, an implicit step; a step's deferred keys *)
(*             are a second write of the same tenant)                      *)
(*   land      the committer lands tenant ver's write of keys on slot      *)
(*   plan      reader r pins key of slot; ver is the version the runtime   *)
(*             planned (0: absent, the tenant did not write key)           *)
(*   read      reader r's delayed read returned got (a tenant's rows, or   *)
(*             Raised = -1: "is not readable")                             *)
(* Versions are per slot: the k-th tenant (runtime step) registering on a  *)
(* slot is version k.  A reader is one (planned read, slot, key).          *)
(***************************************************************************)
EXTENDS Tenancy, TenancyTraceData, Sequences, TLC

VARIABLE l

TraceInit == Init /\ l = 1

E == Trace[l]

\* A new tenant takes the slot right before it registers (not an event).
TraceReuse ==
    /\ l <= Len(Trace)
    /\ E.ev = "register"
    /\ ver[E.slot] < E.ver
    /\ reuse(E.slot)
    /\ UNCHANGED l

TraceRegister(e) ==
    /\ e.ev = "register"
    /\ ver[e.slot] = e.ver
    /\ register(e.slot, e.keys)

TraceLand(e) ==
    /\ e.ev = "land"
    /\ land(e.slot, e.ver, e.keys)

\* The runtime's planned version equals the spec's pin (or both say absent).
TracePlan(e) ==
    /\ e.ev = "plan"
    /\ plan(e.r, e.slot, e.key)
    /\ IF e.ver = 0 THEN e.key \notin carry[e.slot][want'[e.r][2]]
                    ELSE /\ want'[e.r][2] = e.ver
                         /\ e.key \in carry[e.slot][e.ver]

\* The rows the runtime served are the rows the spec's read returns.
TraceRead(e) ==
    /\ e.ev = "read"
    /\ read(e.r)
    /\ got'[e.r] = e.got

TraceNext ==
    \/ TraceReuse
    \/ /\ l <= Len(Trace)
       /\ LET e == E IN TraceRegister(e) \/ TraceLand(e) \/ TracePlan(e) \/ TraceRead(e)
       /\ l' = l + 1

TraceDone == l > Len(Trace) /\ UNCHANGED <<vars, l>>

TraceSpec == TraceInit /\ [][TraceNext \/ TraceDone]_<<vars, l>>
=============================================================================
