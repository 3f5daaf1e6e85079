---------------------------- MODULE StagingTrace ----------------------------
(***************************************************************************)
(* Trace validation of the staging pool against the real Staging spec, in  *)
(* the style of etcd-raft's and CCF's trace specs: every logged runtime    *)
(* event is mapped to the Staging action it performs (with the variables   *)
(* it sets), the spec's own guards must allow it, the runtime's reported   *)
(* bookkeeping (the page's write holds and its reader) must equal the      *)
(* spec's after the step, and TLC checks Staging's real invariants         *)
(* (TypeOK, ExactlyOnce, BoundedStaging with Depth = the configured        *)
(* staging_depth, PageExclusive) in every state along the trace.           *)
(*                                                                         *)
(* The trace itself is the constant Trace of the generated module          *)
(* StagingTraceData (omni_cache/verify/traces.py writes it from a          *)
(* TraceRecorder): a sequence of records                                   *)
(*   [ev, slot, src, dst, step, holds, reading]                            *)
(* ev: claim abort save consume release (fired triggers) or open hold      *)
(* unhold done_reading reject (notes); slot: the page index (0-based, -1:  *)
(* none); src/dst: the page's machine state before/after; step: the        *)
(* runtime step id (-1: none); holds/reading: the page's write holds and   *)
(* its reader after the event (notes only; -1: not reported).             *)
(*                                                                         *)
(* Runtime step ids are mapped to the spec's ids (1, 2, ... in save order, *)
(* Staging's nextId) by the ghost map idmap.  A hold is registered while   *)
(* the page is claimed (the manager registers the immediate write before   *)
(* it issues the id), so the spec's save decides withWrite by it.          *)
(*                                                                         *)
(* Accepted iff TLC exits 0: an event the spec does not allow leaves no    *)
(* successor (deadlock, exit 11, reported with l, the event index); a      *)
(* state breaking an invariant is exit 12.                                 *)
(***************************************************************************)
EXTENDS Staging, StagingTraceData, Sequences, TLC

NoStep == -1

VARIABLES
    l,       \* the next trace event to replay (1-based)
    idmap,   \* runtime step id -> the spec's step id
    held     \* held[p]: a write hold was registered on claimed page p, not yet saved

traceVars == <<l, idmap, held>>

TraceInit ==
    /\ Init
    /\ l = 1
    /\ idmap = [s \in {} |-> 0]
    /\ held = [p \in Pages |-> FALSE]

E == Trace[l]
P == E.slot + 1

\* The runtime's bookkeeping after the event equals the spec's.
HoldsAfter(p) == Cardinality({i \in writes' : at'[i] = p}) + (IF held'[p] THEN 1 ELSE 0)
Observed(e, p) ==
    p \in Pages =>
        /\ page[p] = e.src /\ page'[p] = e.dst
        /\ e.holds = -1 \/ HoldsAfter(p) = e.holds
        /\ e.reading = -1 \/ reading'[p] = (e.reading = 1)

Known(e) == e.step \in DOMAIN idmap

TraceClaim(e, p) ==
    /\ e.ev = "claim"
    /\ claim(p)
    /\ UNCHANGED <<idmap, held>>

TraceAbort(e, p) ==
    /\ e.ev = "abort"
    /\ mine = p
    /\ ~held[p]
    /\ abort
    /\ UNCHANGED <<idmap, held>>

TraceHold(e, p) ==
    /\ e.ev = "hold"
    /\ page[p] = "claimed" /\ mine = p /\ ~held[p]
    /\ held' = [held EXCEPT ![p] = TRUE]
    /\ UNCHANGED <<vars, idmap>>

TraceSave(e, p) ==
    /\ e.ev = "save"
    /\ mine = p
    /\ e.step # NoStep /\ ~Known(e)
    /\ save
    /\ writes' = IF held[p] THEN writes \cup {nextId} ELSE writes
    /\ idmap' = idmap @@ (e.step :> nextId)
    /\ held' = [held EXCEPT ![p] = FALSE]

TraceConsume(e, p) ==
    /\ e.ev = "consume"
    /\ Known(e)
    /\ at[idmap[e.step]] = p
    /\ consume(idmap[e.step])
    /\ UNCHANGED <<idmap, held>>

TraceReject(e) ==
    /\ e.ev = "reject"
    /\ IF Known(e) THEN reject(idmap[e.step])
                   ELSE \E i \in StepIds : i >= nextId /\ reject(i)
    /\ UNCHANGED <<idmap, held>>

TraceDoneReading(e, p) ==
    /\ e.ev = "done_reading"
    /\ done_reading(p)
    /\ UNCHANGED <<idmap, held>>

\* A write hold on page p ends: the write landed (Staging's land).
TraceUnhold(e, p) ==
    /\ e.ev = "unhold"
    /\ Known(e)
    /\ at[idmap[e.step]] = p
    /\ land(idmap[e.step])
    /\ UNCHANGED <<idmap, held>>

TraceRelease(e, p) ==
    /\ e.ev = "release"
    /\ release(p)
    /\ UNCHANGED <<idmap, held>>

\* The pool was created (logs the configured depth): nothing moves.
TraceOpen(e) ==
    /\ e.ev = "open"
    /\ UNCHANGED <<vars, idmap, held>>

TraceNext ==
    /\ l <= Len(Trace)
    /\ LET e == E
           p == P
       IN /\ \/ TraceOpen(e)
             \/ TraceReject(e)
             \/ /\ p \in Pages
                /\ \/ TraceClaim(e, p) \/ TraceAbort(e, p) \/ TraceHold(e, p)
                   \/ TraceSave(e, p) \/ TraceConsume(e, p)
                   \/ TraceDoneReading(e, p) \/ TraceUnhold(e, p) \/ TraceRelease(e, p)
          /\ Observed(e, p)
    /\ l' = l + 1

\* The whole trace was replayed: stutter (so only a stuck replay deadlocks).
TraceDone == l > Len(Trace) /\ UNCHANGED <<vars, traceVars>>

TraceSpec == TraceInit /\ [][TraceNext \/ TraceDone]_<<vars, traceVars>>
=============================================================================
