------------------------------ MODULE MCStaging ------------------------------
(***************************************************************************)
(* Model-checking harness for Staging.  The constants live in the .cfg     *)
(* files (MCStaging.cfg: 2 pages, 3 saves, 2 misbehaving calls); enlarge   *)
(* them there, or pass another cfg with `omni-cache verify --cfg`.         *)
(*                                                                         *)
(* The alternative specifications below drop or add one fairness          *)
(* condition; MCStagingLazyBuilder.cfg and MCStagingTimeout.cfg use them.  *)
(***************************************************************************)
EXTENDS Staging

\* An output builder that may stop consuming (abandons its step ids).
LazyBuilderSpec == Init /\ [][Next]_vars /\ EngineFair /\ CommitterFair

\* The same lazy builder, but the staging timeout fires once the wait is
\* hopeless: this is what ends the wait in the runtime.
TimeoutSpec == LazyBuilderSpec /\ WF_vars(timeout)
=============================================================================
