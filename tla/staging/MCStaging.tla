------------------------------ MODULE MCStaging ------------------------------
(***************************************************************************)
(* Model-checking harness for Staging.  The constants live in the .cfg     *)
(* files (MCStaging.cfg: 2 pages, 3 saves, 2 misbehaving calls); enlarge   *)
(* them there, or pass another cfg with `omni-cache verify --cfg`.         *)
(*                                                                         *)
(* The alternative specifications below drop or add one fairness          *)
(* condition; MCStagingLazyBuilder.cfg and MCStagingTimeout.cfg use them;  *)
(* FailingCopiesSpec (MCStagingFailingCopies.cfg) lets every copy fail.    *)
(***************************************************************************)
EXTENDS Staging

\* An output builder that may stop consuming (abandons its step ids).
LazyBuilderSpec == Init /\ [][Next]_vars /\ EngineFair /\ CommitterFair

\* The same lazy builder, but the staging timeout fires once the wait is
\* hopeless: this is what ends the wait in the runtime.
TimeoutSpec == LazyBuilderSpec /\ WF_vars(timeout)

\* Every copy fails: no save ever issues a step id, each claimed page goes
\* back by abort (fair here: the failed save_outputs call gives the page back
\* before it raises).  MCStagingFailingCopies.cfg checks AllSavesEnd with it.
FailingNext ==
    \/ (\E p \in Pages : claim(p)) \/ wait \/ timeout \/ abort
    \/ BuilderStep \/ CallerStep \/ CommitterStep \/ Terminating
FailingCopiesSpec ==
    /\ Init /\ [][FailingNext]_vars
    /\ WF_vars(\E p \in Pages : claim(p)) /\ WF_vars(wait) /\ WF_vars(abort)
    /\ BuilderFair /\ CommitterFair
=============================================================================
