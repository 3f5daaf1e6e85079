-------------------------------- MODULE Writes --------------------------------
(***************************************************************************)
(* Pool writes of the omni prefix cache: the write lifecycle, the copy     *)
(* queue and the sticky failure (DESIGN 3-4, I8, I9).                      *)
(*                                                                         *)
(* Each write belongs to a request and is immediate (enqueued at save) or  *)
(* deferred (JOIN_ON_FINISH: enqueued when its request finishes or aborts, *)
(* or early when the GPU-byte budget flushes it).  Writes of a finished or *)
(* aborted request go to the front of the queue.  One committer pops the   *)
(* queue head, copies and commits it.  An error fails a write and makes    *)
(* the manager failed for good: every queued and pending write fails.      *)
(*                                                                         *)
(* Actions that move a write are named exactly like WRITE_TABLE's triggers *)
(* (enqueue, start_copy, finish_copy, commit, fail) and move only along    *)
(* WriteMachine!WriteEdges.                                                *)
(*                                                                         *)
(* Code: omni_cache/writes.py WriteBook (enqueue with front=True for      *)
(* finished/aborted requests, pop, fire, fail) and the manager's committer.*)
(*                                                                         *)
(* Invariants: TypeOK, QueueConsistent.  Properties: StickyFailure (I8,   *)
(* an action property: once failed, always failed, and no copy starts),    *)
(* AbortsLand (I9: every write of a finished or aborted request ends,      *)
(* written or failed) under weak fairness of the committer.                *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, WriteMachine

CONSTANTS
    NumWrites,   \* pool writes registered over the run
    NumReqs,     \* requests they belong to (write i to request ReqOf(i))
    MaxErrors    \* spontaneous errors (0 or 1): the first one fails the manager

ASSUME NumWrites \in Nat \ {0} /\ NumReqs \in Nat \ {0} /\ MaxErrors \in Nat

Writes == 1..NumWrites
Reqs == 1..NumReqs
ReqOf(i) == ((i - 1) % NumReqs) + 1

VARIABLES
    w,         \* w[i] \in WriteStates
    deferred,  \* deferred[i]: JOIN_ON_FINISH (fixed at registration)
    queue,     \* the copy queue, a sequence of write ids
    busy,      \* the write the committer is copying/committing (0 = none)
    finished,  \* finished[r]: request r finished or was aborted
    failure,   \* the sticky failure (I8)
    errors     \* spontaneous errors so far

vars == <<w, deferred, queue, busy, finished, failure, errors>>

Range(s) == {s[k] : k \in 1..Len(s)}
Remove(s, i) == SelectSeq(s, LAMBDA x : x # i)

WMove(i, t) == /\ WCanFire(w[i], t)
               /\ w' = [w EXCEPT ![i] = WAfter(w[i], t)]

TypeOK ==
    /\ w \in [Writes -> WriteStates]
    /\ deferred \in [Writes -> BOOLEAN]
    /\ queue \in Seq(Writes)
    /\ busy \in Writes \cup {0}
    /\ finished \in [Reqs -> BOOLEAN]
    /\ failure \in BOOLEAN
    /\ errors \in 0..MaxErrors

Init ==
    /\ w = [i \in Writes |-> "pending"]
    /\ deferred \in [Writes -> BOOLEAN]
    /\ queue = <<>>
    /\ busy = 0
    /\ finished = [r \in Reqs |-> FALSE]
    /\ failure = FALSE
    /\ errors = 0

\* The write must be queued now: immediate, or its request has ended.
Due(i) == ~deferred[i] \/ finished[ReqOf(i)]

\* Push a pending write into the queue: at the front when its request has
\* finished or aborted (I9), else at the back (save, or a budget flush).
enqueue(i) ==
    /\ WMove(i, "enqueue")
    /\ queue' = IF finished[ReqOf(i)] THEN <<i>> \o queue ELSE Append(queue, i)
    /\ UNCHANGED <<deferred, busy, finished, failure, errors>>

\* Request r finishes or is aborted (new_step_starts sees FINISHED/ABORTED).
finish(r) ==
    /\ ~finished[r]
    /\ finished' = [finished EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<w, deferred, queue, busy, failure, errors>>

start_copy(i) ==
    /\ ~failure
    /\ busy = 0
    /\ queue # <<>>
    /\ Head(queue) = i
    /\ WMove(i, "start_copy")
    /\ queue' = Tail(queue)
    /\ busy' = i
    /\ UNCHANGED <<deferred, finished, failure, errors>>

finish_copy(i) ==
    /\ busy = i
    /\ WMove(i, "finish_copy")
    /\ UNCHANGED <<deferred, queue, busy, finished, failure, errors>>

commit(i) ==
    /\ busy = i
    /\ WMove(i, "commit")
    /\ busy' = 0
    /\ UNCHANGED <<deferred, queue, finished, failure, errors>>

\* A live write fails: a spontaneous error (the first), or because the
\* manager already failed (every queued and pending write follows).
fail(i) ==
    /\ failure \/ errors < MaxErrors
    /\ WMove(i, "fail")
    /\ errors' = IF failure THEN errors ELSE errors + 1
    /\ failure' = TRUE
    /\ queue' = Remove(queue, i)
    /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<deferred, finished>>

Terminating ==
    /\ \A i \in Writes : w[i] \in EndStates
    /\ UNCHANGED vars

Next ==
    \/ \E i \in Writes : enqueue(i) \/ start_copy(i) \/ finish_copy(i) \/ commit(i) \/ fail(i)
    \/ \E r \in Reqs : finish(r)
    \/ Terminating

Fairness ==
    /\ WF_vars(\E i \in Writes : Due(i) /\ enqueue(i))
    /\ WF_vars(\E i \in Writes : start_copy(i) \/ finish_copy(i) \/ commit(i))
    /\ WF_vars(\E i \in Writes : failure /\ fail(i))

Spec == Init /\ [][Next]_vars /\ Fairness

(***************************************************************************)
(* Invariants and properties                                               *)
(***************************************************************************)
\* The queue holds exactly the queued writes, each once; the committer
\* holds the one write that is copying or host_ready.
QueueConsistent ==
    /\ Len(queue) = Cardinality(Range(queue))
    /\ \A i \in Writes : (w[i] = "queued") <=> (i \in Range(queue))
    /\ \A i \in Writes : (w[i] \in {"copying", "host_ready"}) <=> (busy = i)

\* I8: once failed, always failed, and the committer starts no copy any more
\* (WriteBook.pop returns nothing once failed; a copy already in flight may end).
StickyFailure ==
    [][failure => /\ failure'
                  /\ \A i \in Writes : ~(w[i] = "queued" /\ w'[i] = "copying")]_vars

\* I9: every write of a finished or aborted request ends (written or failed).
AbortsLand ==
    \A i \in Writes : finished[ReqOf(i)] ~> (w[i] \in EndStates)
=============================================================================
