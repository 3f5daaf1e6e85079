----------------------------- MODULE WritesTrace -----------------------------
(***************************************************************************)
(* Trace validation of the write book against the real Writes spec (the    *)
(* style of etcd-raft's and CCF's trace specs): every logged runtime event *)
(* is mapped to the Writes action it performs, the spec's guards must      *)
(* allow it (the committer copies only the queue's head: landing out of    *)
(* order leaves no successor), the write's recorded state must equal the   *)
(* spec's after the step, and TLC checks Writes' invariants (TypeOK,       *)
(* QueueConsistent, FailureSticks, AdmissionsCounted, EndedByOwner) and    *)
(* action properties (StickyFailure, FrontFirst) along the trace.          *)
(*                                                                         *)
(* The generated module WritesTraceData (omni_cache/verify/traces.py)      *)
(* defines Trace, a sequence of records [ev, tid, dst, deferred, tids]:    *)
(*   register       write tid registered (deferred: JOIN_ON_FINISH)        *)
(*   enqueue_back   write tid pushed to the back (immediate, budget flush) *)
(*   enqueue_front  the writes tids pushed to the front, in that order:    *)
(*                  mapped to finish (the end of an admission)             *)
(*   enqueue start_copy finish_copy commit fail: the fired triggers, dst   *)
(*                  the write's state after it                             *)
(* and TraceReq[tid], the request the trace assigns to each write: the     *)
(* writes pushed to the front together form one admission that ends then   *)
(* (a finished/aborted request, or writes a planned read needs first);     *)
(* every other write is its own request.  An admission is admitted by an   *)
(* implicit step right before its first write registers.                   *)
(***************************************************************************)
EXTENDS Writes, WritesTraceData, TLC

TraceReqOf(i) == TraceReq[i]

VARIABLE l

TraceInit == Init /\ l = 1

E == Trace[l]

\* The write's recorded state after a fired trigger equals the spec's.
Observed(e) == e.dst = "-" \/ w'[e.tid] = e.dst

TraceRegister(e) ==
    /\ e.ev = "register"
    /\ register(e.tid)
    /\ deferred'[e.tid] = e.deferred

TraceEnqueueBack(e) ==
    /\ e.ev = "enqueue_back"
    /\ enqueue(e.tid)

TraceEnqueueFront(e) ==
    /\ e.ev = "enqueue_front"
    /\ LET r == TraceReqOf(e.tids[1]) IN finish(r, gen[r], lastSeq + 1)
    /\ queue' = e.tids \o queue

\* Writes.Orders, narrowed to the order the runtime pushed (when it is one of
\* them): enumerating every ordering of a large batch is what TLC cannot do.
TraceOrders(S) ==
    IF l <= Len(Trace) /\ Trace[l].ev = "enqueue_front" /\ Range(Trace[l].tids) = S
                      /\ Len(Trace[l].tids) = Cardinality(S)
       THEN {Trace[l].tids}
       ELSE {}

\* The fired "enqueue" of a write the preceding note already moved.
TraceEnqueued(e) ==
    /\ e.ev = "enqueue"
    /\ w[e.tid] = "queued"
    /\ UNCHANGED vars

TraceCopy(e) ==
    \/ e.ev = "start_copy" /\ start_copy(e.tid)
    \/ e.ev = "finish_copy" /\ finish_copy(e.tid)
    \/ e.ev = "commit" /\ commit(e.tid)

\* The first fail of a failure fails the write and every queued write at
\* once; the runtime then fires fail on each of those: already failed.
TraceFail(e) ==
    /\ e.ev = "fail"
    /\ IF w[e.tid] = "failed" THEN UNCHANGED vars ELSE fail(e.tid)

\* The admission of the next registering write's request (not an event).
TraceAdmit ==
    /\ l <= Len(Trace)
    /\ E.ev = "register"
    /\ gen[TraceReqOf(E.tid)] = 0
    /\ admit(TraceReqOf(E.tid), lastSeq + 1)
    /\ UNCHANGED l

TraceNext ==
    \/ TraceAdmit
    \/ /\ l <= Len(Trace)
       /\ LET e == E IN
              /\ \/ TraceRegister(e) \/ TraceEnqueueBack(e) \/ TraceEnqueueFront(e)
                 \/ TraceEnqueued(e) \/ TraceCopy(e) \/ TraceFail(e)
              /\ Observed(e)
       /\ l' = l + 1

TraceDone == l > Len(Trace) /\ UNCHANGED <<vars, l>>

TraceSpec == TraceInit /\ [][TraceNext \/ TraceDone]_<<vars, l>>
=============================================================================
