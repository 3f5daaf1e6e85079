------------------------------- MODULE MCWrites -------------------------------
(***************************************************************************)
(* Model-checking harness for Writes.  Constants live in the .cfg files    *)
(* (MCWrites.cfg: 2 writes of one request id admitted twice -- a REPLACED  *)
(* reuse --, 4 scheduler steps, one possible error; MCWritesNightly.cfg: 3 *)
(* writes, two of them of request 1).  Enlarge them there, or pass another *)
(* cfg with `omni-cache verify --cfg`.  LiveSpec: MCWritesLive.cfg.       *)
(***************************************************************************)
EXTENDS Writes

\* Write i belongs to request id ((i - 1) % NumReqs) + 1.
MCReqOf(i) == ((i - 1) % NumReqs) + 1

\* A fair scheduler (it keeps applying steps while it has sequence numbers)
\* and a fair engine (it saves every write of a live admission), besides the
\* committer: MCWritesLive.cfg checks SchedulerProgress and SavesAccepted.
LiveSpec ==
    /\ Spec
    /\ WF_vars(\E r \in Reqs, s \in Seqs : admit(r, s) \/ \E g \in Gens : finish(r, g, s))
    /\ \A i \in Writes : WF_vars(register(i))

\* The cfgs that model shutdown substitute this for Writes' ShutdownModeled.
MCShutdownModeled == TRUE

\* Reachability, not safety: MCWritesReachStop.cfg expects TLC to violate it, i.e. to
\* reach a shutdown whose committer stopped. A spec where shutdown or stop can never
\* happen would check ShutdownDrains and NoSaveAfterShutdown vacuously.
NeverStopped == ~stopped
=============================================================================
