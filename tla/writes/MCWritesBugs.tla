----------------------------- MODULE MCWritesBugs -----------------------------
(***************************************************************************)
(* Broken on purpose: one bug per cfg, each caught by the invariant or     *)
(* property that states it:                                                *)
(*  - MCWritesStepWhenFailed.cfg: a failed manager still admits            *)
(*    (StickyFailure: no scheduler step once failed);                      *)
(*  - MCWritesFinishEndsNothing.cfg: FINISHED of the current admission     *)
(*    ends nothing (TerminalsEnd);                                         *)
(*  - MCWritesFinishNoAdvance.cfg: a terminal step does not advance the    *)
(*    replay watermark, so it could be applied twice (ReplayRefused);      *)
(*  - MCWritesErrorUncounted.cfg: an error fails the manager without being *)
(*    counted (FailureSticks: the failure is set exactly by an error);     *)
(*  - MCWritesFailLanded.cfg: an error fails a write that already landed   *)
(*    (TypeOK: "fail" is no edge out of "written");                        *)
(*  - MCWritesStuckScheduler.cfg: a healthy manager refuses terminal       *)
(*    events (SchedulerProgress, under LiveSpec);                          *)
(*  - MCWritesSaveRefused.cfg: a REPLACED admission's saves are refused    *)
(*    (SavesAccepted, under LiveSpec).                                     *)
(***************************************************************************)
EXTENDS MCWrites

admit_when_failed(r, seq) ==
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

finish_ends_nothing(r, g, seq) ==
    /\ ~failure
    /\ seq = lastSeq + 1
    /\ g \in 1..gen[r]
    /\ lastSeq' = seq
    /\ applied' = applied \cup {seq}
    /\ terminals' = terminals \cup {<<r, g>>}
    /\ UNCHANGED <<w, ended, queue, own, deferred, busy, gen, admits, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

finish_no_advance(r, g, seq) ==
    /\ ~failure
    /\ seq = lastSeq + 1
    /\ g \in 1..gen[r]
    /\ applied' = applied \cup {seq}
    /\ terminals' = terminals \cup {<<r, g>>}
    /\ IF g = gen[r] /\ <<r, g>> \notin ended
          THEN EndAdmission(<<r, g>>)
          ELSE UNCHANGED <<w, ended, queue>>
    /\ UNCHANGED <<own, deferred, busy, gen, lastSeq, admits, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* The first error, as fail's ELSE branch, but the error is not counted.
fail_uncounted(i) ==
    /\ Registered(i)
    /\ w[i] \in LiveStates
    /\ ~failure
    /\ w' = [j \in Writes |-> IF j = i \/ j \in Range(queue) THEN WAfter(w[j], "fail") ELSE w[j]]
    /\ failure' = TRUE
    /\ queue' = <<>>
    /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals, errors>>
    /\ UNCHANGED <<shut, stopped>>

\* An error on any registered write, landed ones included.
fail_landed(i) ==
    /\ Registered(i)
    /\ ~failure
    /\ errors < MaxErrors
    /\ w' = [j \in Writes |-> IF j = i \/ j \in Range(queue) THEN WAfter(w[j], "fail") ELSE w[j]]
    /\ errors' = errors + 1
    /\ failure' = TRUE
    /\ queue' = <<>>
    /\ busy' = IF busy = i THEN 0 ELSE busy
    /\ UNCHANGED <<own, deferred, gen, ended, lastSeq, applied, admits, terminals>>
    /\ UNCHANGED <<shut, stopped>>

finish_refused(r, g, seq) == FALSE

register_first_admission_only(i) ==
    /\ ~failure
    /\ ~Registered(i)
    /\ gen[ReqOf(i)] = 1
    /\ <<ReqOf(i), gen[ReqOf(i)]>> \notin ended
    /\ own' = [own EXCEPT ![i] = <<ReqOf(i), gen[ReqOf(i)]>>]
    /\ deferred' \in {[deferred EXCEPT ![i] = d] : d \in BOOLEAN}
    /\ UNCHANGED <<w, queue, busy, gen, ended, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>
===============================================================================
