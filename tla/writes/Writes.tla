-------------------------------- MODULE Writes --------------------------------
(***************************************************************************)
(* Pool writes of the omni prefix cache: the write lifecycle, the copy     *)
(* queue, request identity and the sticky failure (I8, I9; sections 5      *)
(* and 6 of spec/contract.md).                                             *)
(*                                                                         *)
(* A request id is admitted (STARTED), and may be admitted again by a new  *)
(* admission (REPLACED): gen[r] is its current admission.  Each write is   *)
(* registered by the current admission of its request (own[i] = <<r, g>>), *)
(* immediate (enqueued at the back at save) or deferred (JOIN_ON_FINISH:   *)
(* enqueued when its admission ends, or early at the back by a GPU-byte    *)
(* budget flush).  An admission ends by FINISHED/ABORTED carrying its      *)
(* owner, or by a REPLACED of its request id; its open writes go to the    *)
(* queue's front in that very step (I9: the old admission's rows still     *)
(* land).  A late terminal event of an old admission ends nothing.  Every  *)
(* scheduler step carries a sequence number; a replayed step (a sequence   *)
(* already applied) changes nothing.  One committer pops the queue head,   *)
(* copies and commits it.  An error fails a write and every queued write   *)
(* and makes the manager failed for good.  Shutdown (contract 4.6; in the  *)
(* cfgs that set ShutdownModeled): once it began, saves and scheduler      *)
(* steps are refused, the saves already in progress push their writes,    *)
(* and the committer stops only after the queue drained: no write is ever *)
(* left queued without a committer.                                        *)
(*                                                                         *)
(* Actions that move a write are named like WRITE_TABLE's triggers         *)
(* (enqueue, start_copy, finish_copy, commit, fail); finish and admit      *)
(* fire enqueue on the writes of the admission they end (the manifest's    *)
(* conformance entry says so).                                             *)
(*                                                                         *)
(* Code: omni_cache/runtime/writes.py WriteBook (register, enqueue with front=True *)
(* for ended admissions, pop, fire, fail), the manager's committer, and    *)
(* the adapter's request identity (owner, REPLACED, step sequence).        *)
(*                                                                         *)
(* Invariants: TypeOK, QueueConsistent, FailureSticks (I8: a failed write  *)
(* implies the manager's failure), AdmissionsCounted (a replayed step      *)
(* admits nobody), EndedByOwner (a late terminal event ends nothing).     *)
(* Properties: StickyFailure (I8, action), FrontFirst                     *)
(* (I9 ordering, action), AbortsLand (I9: every write of an ended          *)
(* admission ends) under weak fairness of the committer alone, and         *)
(* FailureEndsAll (I8: once failed, every registered write ends);        *)
(* ShutdownDrains (once the committer stopped, nothing is queued or in    *)
(* copy and every save's immediate write has ended) and the action        *)
(* property NoSaveAfterShutdown.                                          *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, WriteMachine

CONSTANTS
    NumWrites,   \* pool writes registered over the run
    NumReqs,     \* request ids
    ReqOf(_),    \* the request id whose admission registers write i
    MaxGen,      \* admissions per request id (2: one REPLACED reuse)
    MaxSeq,      \* scheduler steps (sequence numbers 1..MaxSeq)
    MaxErrors    \* spontaneous errors (0 or 1): the first one fails the manager

ASSUME NumWrites \in Nat \ {0} /\ NumReqs \in Nat \ {0} /\ MaxGen \in Nat \ {0}
ASSUME MaxSeq \in Nat /\ MaxErrors \in Nat

Writes == 1..NumWrites
Reqs == 1..NumReqs
Gens == 1..MaxGen
Seqs == 1..MaxSeq
NoOwner == <<0, 0>>

VARIABLES
    w,         \* w[i] \in WriteStates
    own,       \* own[i]: the admission <<r, g>> that registered write i (NoOwner: not yet)
    deferred,  \* deferred[i]: JOIN_ON_FINISH (fixed at registration)
    queue,     \* the copy queue, a sequence of write ids
    busy,      \* the write the committer is copying/committing (0 = none)
    gen,       \* gen[r]: the current admission of request id r (0 = never admitted)
    ended,     \* admissions that ended (finished, aborted or replaced)
    lastSeq,   \* the newest scheduler step applied
    applied,   \* ghost: the sequence numbers of every scheduler step applied
    admits,    \* ghost: <<r, seq>> of every admission a scheduler step made
    terminals, \* ghost: the owners <<r, g>> that FINISHED/ABORTED events named
    failure,   \* the sticky failure (I8)
    errors,    \* spontaneous errors so far
    shut,      \* shutdown began: saves and scheduler steps are refused (contract 4.6)
    stopped    \* the committer stopped (shutdown drained the queue first)

vars == <<w, own, deferred, queue, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors,
          shut, stopped>>

\* Whether the model includes shutdown: FALSE here (the cfgs of a running
\* manager), TRUE in the cfgs that substitute MCWrites' MCShutdownModeled.
ShutdownModeled == FALSE

Range(s) == {s[k] : k \in 1..Len(s)}
Remove(s, i) == SelectSeq(s, LAMBDA x : x # i)
Pos(s, x) == CHOOSE k \in 1..Len(s) : s[k] = x
NoWrite == 0
\* The queue's head, total: NoWrite (no write) for an empty queue.
First(s) == IF s = <<>> THEN NoWrite ELSE Head(s)
Registered(i) == own[i] # NoOwner

WMove(i, t) == /\ WCanFire(w[i], t)
               /\ w' = [w EXCEPT ![i] = WAfter(w[i], t)]

\* The sequence of the writes in set S, by id (the order they were registered).
RECURSIVE SeqOf(_)
SeqOf(S) == IF S = {} THEN <<>>
            ELSE LET m == CHOOSE x \in S : \A y \in S : x <= y
                 IN <<m>> \o SeqOf(S \ {m})

TypeOK ==
    /\ w \in [Writes -> WriteStates]
    /\ own \in [Writes -> ({NoOwner} \cup (Reqs \X Gens))]
    /\ deferred \in [Writes -> BOOLEAN]
    /\ queue \in Seq(Writes)
    /\ busy \in Writes \cup {0}
    /\ gen \in [Reqs -> 0..MaxGen]
    /\ ended \subseteq Reqs \X Gens
    /\ lastSeq \in 0..MaxSeq
    /\ applied \subseteq Seqs
    /\ admits \subseteq Reqs \X Seqs
    /\ terminals \subseteq Reqs \X Gens
    /\ failure \in BOOLEAN
    /\ errors \in 0..MaxErrors
    /\ shut \in BOOLEAN
    /\ stopped \in BOOLEAN

Init ==
    /\ w = [i \in Writes |-> "pending"]
    /\ own = [i \in Writes |-> NoOwner]
    /\ deferred = [i \in Writes |-> FALSE]
    /\ queue = <<>>
    /\ busy = 0
    /\ gen = [r \in Reqs |-> 0]
    /\ ended = {}
    /\ lastSeq = 0
    /\ applied = {}
    /\ admits = {}
    /\ terminals = {}
    /\ failure = FALSE
    /\ errors = 0
    /\ shut = FALSE
    /\ stopped = FALSE

\* The orderings of a finite set S (sequences holding each element once).
\* (WritesTrace narrows this to the order the runtime logged.)
Orders(S) == {f \in [1..Cardinality(S) -> S] : \A j, k \in DOMAIN f : j # k => f[j] # f[k]}

\* Admission a ends: its pending writes go to the queue's front (in some
\* order), ahead of everything queued before (I9).
EndAdmission(a) ==
    LET open == {i \in Writes : own[i] = a /\ w[i] = "pending"}
    IN /\ ended' = ended \cup {a}
       /\ w' = [i \in Writes |-> IF i \in open THEN WAfter(w[i], "enqueue") ELSE w[i]]
       /\ queue' \in {order \o queue : order \in Orders(open)}

(***************************************************************************)
(* Scheduler steps (new_step_starts; refused once failed, I8)              *)
(***************************************************************************)
\* Step seq admits request id r: STARTED, or REPLACED when r has a live
\* admission already (that admission ends now; its writes still land).
admit(r, seq) ==
    /\ ~failure
    /\ ~shut
    /\ seq = lastSeq + 1
    /\ gen[r] < MaxGen
    /\ gen' = [gen EXCEPT ![r] = @ + 1]
    /\ lastSeq' = seq
    /\ applied' = applied \cup {seq}
    /\ admits' = admits \cup {<<r, seq>>}
    /\ IF gen[r] > 0 /\ <<r, gen[r]>> \notin ended
          THEN EndAdmission(<<r, gen[r]>>)
          ELSE UNCHANGED <<w, ended, queue>>
    /\ UNCHANGED <<own, deferred, busy, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* Step seq carries FINISHED/ABORTED for owner <<r, g>>.  The current live
\* admission ends; a late terminal event of an older admission ends nothing.
finish(r, g, seq) ==
    /\ ~failure
    /\ ~shut
    /\ seq = lastSeq + 1
    /\ g \in 1..gen[r]
    /\ lastSeq' = seq
    /\ applied' = applied \cup {seq}
    /\ terminals' = terminals \cup {<<r, g>>}
    /\ IF g = gen[r] /\ <<r, g>> \notin ended
          THEN EndAdmission(<<r, g>>)
          ELSE UNCHANGED <<w, ended, queue>>
    /\ UNCHANGED <<own, deferred, busy, gen, admits, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* A scheduler step already applied (same sequence) comes again: no-op.
replay(seq) ==
    /\ seq \in 1..lastSeq
    /\ UNCHANGED vars

(***************************************************************************)
(* Engine (save_outputs) and committer                                     *)
(***************************************************************************)
\* save_outputs registers write i for the live admission of its request; a
\* save is refused once shutdown began (it had not claimed its page then; a
\* save that had claimed it registered before).
register(i) ==
    /\ ~failure
    /\ ~shut
    /\ ~Registered(i)
    /\ gen[ReqOf(i)] > 0
    /\ <<ReqOf(i), gen[ReqOf(i)]>> \notin ended
    /\ own' = [own EXCEPT ![i] = <<ReqOf(i), gen[ReqOf(i)]>>]
    /\ deferred' \in {[deferred EXCEPT ![i] = d] : d \in BOOLEAN}
    /\ UNCHANGED <<w, queue, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* Push a registered pending write to the back of the queue: an immediate
\* write at save, or a deferred one flushed early by the GPU-byte budget.
\* (The engine checked the failure before it saved; the committer may fail
\* meanwhile, so this may race with the failure.)
\* A budget flush runs inside a save, so no deferred write is pushed once the
\* committer stopped; an immediate write is pushed by the save that
\* registered it, whenever that save gets there (the engine does not look at
\* the committer).
enqueue(i) ==
    /\ Registered(i)
    /\ deferred[i] => ~stopped
    /\ WMove(i, "enqueue")
    /\ queue' = Append(queue, i)
    /\ UNCHANGED <<own, deferred, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

start_copy(i) ==
    /\ ~failure
    /\ ~stopped
    /\ busy = 0
    /\ queue # <<>>
    /\ First(queue) = i
    /\ WMove(i, "start_copy")
    /\ queue' = Tail(queue)
    /\ busy' = i
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

finish_copy(i) ==
    /\ busy = i
    /\ WMove(i, "finish_copy")
    /\ UNCHANGED <<own, deferred, queue, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

commit(i) ==
    /\ busy = i
    /\ WMove(i, "commit")
    /\ busy' = 0
    /\ UNCHANGED <<own, deferred, queue, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* An error on live write i (the committer's copy, or a save that fails after
\* registering i): i and every queued write fail, the failure is set (I8).
\* Once failed, a write queued afterwards (an enqueue that raced with the
\* failure) fails instead of being copied, and so does a write still pending
\* (a deferred write whose admission can no longer end: every later step is
\* refused), so no write stays open after the failure.
fail(i) ==
    /\ Registered(i)
    /\ w[i] \in LiveStates
    /\ IF failure
          THEN /\ w[i] \in {"pending", "queued"}
               /\ WMove(i, "fail")
               /\ queue' = Remove(queue, i)
               /\ UNCHANGED <<busy, failure, errors>>
          ELSE /\ errors < MaxErrors
               /\ w' = [j \in Writes |-> IF j = i \/ j \in Range(queue) THEN WAfter(w[j], "fail") ELSE w[j]]
               /\ errors' = errors + 1
               /\ failure' = TRUE
               /\ queue' = <<>>
               /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals>>
    /\ UNCHANGED <<shut, stopped>>

(***************************************************************************)
(* Shutdown (contract 4.6)                                                 *)
(***************************************************************************)
\* A save in progress: it registered its immediate write and has not pushed it.
SaveInProgress == \E i \in Writes : Registered(i) /\ ~deferred[i] /\ w[i] = "pending"

\* shutdown() begins: from now on saves and scheduler steps are refused.
shutdown ==
    /\ ShutdownModeled
    /\ ~shut
    /\ shut' = TRUE
    /\ UNCHANGED <<w, own, deferred, queue, busy, gen, ended, lastSeq, applied, admits, terminals,
                   failure, errors, stopped>>

\* The committer stops once the saves in progress pushed their writes and
\* the queue drained (a failed manager's queue is empty already).
stop ==
    /\ shut
    /\ ~stopped
    /\ ~SaveInProgress
    /\ queue = <<>>
    /\ busy = 0
    /\ stopped' = TRUE
    /\ UNCHANGED <<w, own, deferred, queue, busy, gen, ended, lastSeq, applied, admits, terminals,
                   failure, errors, shut>>

\* Nothing queued or being copied and no scheduler step left: stutter.
Terminating ==
    /\ queue = <<>>
    /\ busy = 0
    /\ UNCHANGED vars

Next ==
    \/ \E i \in Writes : register(i) \/ enqueue(i) \/ start_copy(i) \/ finish_copy(i)
                         \/ commit(i) \/ fail(i)
    \/ \E r \in Reqs, s \in Seqs : admit(r, s) \/ \E g \in Gens : finish(r, g, s)
    \/ \E s \in Seqs : replay(s)
    \/ shutdown \/ stop
    \/ Terminating

\* Only the committer is fair: nobody has to flush, finish or replace.  Once
\* failed, the failure itself ends the open writes (WriteBook.fail fails every
\* queued and pending write in the same call).
Fairness == /\ WF_vars(\E i \in Writes : start_copy(i) \/ finish_copy(i) \/ commit(i))
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
    /\ \A i \in Writes : ~Registered(i) => w[i] = "pending"

\* I8: a failed write means the manager is failed.
\* The failure is set exactly by an error (errors counts them).
FailureSticks == /\ (\E i \in Writes : w[i] = "failed") => failure
                 /\ failure = (errors > 0)

\* Each admission of a request id was made by its own scheduler step: a
\* replayed step (same sequence) admits nobody.
AdmissionsCounted == \A r \in Reqs : gen[r] = Cardinality({a \in admits : a[1] = r})

\* An admission ends only by a terminal event naming it, or by a REPLACED
\* (a newer admission of its request id): a late terminal event of an old
\* admission never ends the new one.
EndedByOwner == \A a \in ended : a \in terminals \/ a[2] < gen[a[1]]

\* A terminal event's admission has ended: it ended the current admission,
\* or it came late for an older one that a REPLACED had ended already.
TerminalsEnd == terminals \subseteq ended

\* The replay watermark covers exactly the scheduler steps applied: every
\* applied step is at or below it, so a replay of it is refused (a step that
\* does not advance lastSeq could be applied twice), and every step at or
\* below it was applied (none skipped).
ReplayRefused == applied = 1..lastSeq

\* A terminal event names an admission that exists (the current or an older one).
TerminalsKnown == \A t \in terminals : t[2] <= gen[t[1]]

\* Scheduler steps are applied in sequence order, each once.
SequenceMonotonic == [][lastSeq' >= lastSeq]_vars

\* A write's owner is fixed at registration.
OwnerFixed == [][\A i \in Writes : Registered(i) => own'[i] = own[i]]_vars

\* I8: once failed, always failed, and the committer starts no copy any more
\* (WriteBook.start_next returns nothing once failed; a copy already in flight may end).
StickyFailure ==
    [][failure => /\ failure'
                  /\ lastSeq' = lastSeq          \* new_step_starts refuses every step
                  /\ own' = own                  \* save_outputs refuses to register
                  /\ \A i \in Writes : ~(w[i] = "queued" /\ w'[i] = "copying")]_vars

\* I9 ordering: a write queued because its admission ended goes ahead of
\* every write queued before that step.
FrontFirst ==
    [][\A i \in Writes :
         (w[i] = "pending" /\ w'[i] = "queued" /\ own[i] \in ended')
            => \A j \in Range(queue) : j \in Range(queue') => Pos(queue', i) < Pos(queue', j)]_vars

\* I8: once failed, every registered write ends (no write stays open: a
\* deferred write whose admission can never end fails too).
FailureEndsAll ==
    failure ~> \A i \in Writes : Registered(i) => w[i] \in EndStates

\* Liveness with a fair scheduler and engine (MCWrites.tla LiveSpec, with
\* MCWritesLive.cfg): a healthy manager applies every scheduler step
\* (admissions and terminal events are never refused), and the engine's save
\* for a live admission is never refused either.
SchedulerProgress == <>(lastSeq = MaxSeq \/ failure)
LiveFor(i) == /\ ~failure
              /\ gen[ReqOf(i)] > 0
              /\ <<ReqOf(i), gen[ReqOf(i)]>> \notin ended
SavesAccepted == \A i \in Writes : (~Registered(i) /\ LiveFor(i)) ~> (Registered(i) \/ ~LiveFor(i))

\* Contract 4.6: once the committer stopped, no write is queued or in copy,
\* and every save's immediate write has ended (landed, or failed with the
\* manager): a save accepted after shutdown would leave its write queued
\* with no committer.
ShutdownDrains ==
    stopped => /\ queue = <<>>
               /\ busy = 0
               /\ \A i \in Writes : (Registered(i) /\ ~deferred[i]) => w[i] \in EndStates

\* Contract 4.6: once shutdown began, no save registers a write and no
\* scheduler step is applied.
NoSaveAfterShutdown == [][shut => own' = own /\ lastSeq' = lastSeq]_vars

\* I9: every write of an ended admission ends (written or failed).
AbortsLand ==
    \A i \in Writes : (Registered(i) /\ own[i] \in ended) ~> (w[i] \in EndStates)
=============================================================================
