-------------------- MODULE MCWritesReplayApplies --------------------
(* Broken variant: a replayed scheduler step admits its request again. *)
EXTENDS MCWrites

replay_applied(s) ==
    /\ s \in 1..lastSeq
    /\ \E r \in Reqs : /\ <<r, s>> \in admits
                       /\ gen[r] < MaxGen
                       /\ gen' = [gen EXCEPT ![r] = @ + 1]
                       /\ IF <<r, gen[r]>> \notin ended THEN EndAdmission(<<r, gen[r]>>)
                                                     ELSE UNCHANGED <<w, ended, queue>>
    /\ UNCHANGED <<own, deferred, busy, lastSeq, applied, admits, terminals, failure, errors>>
    /\ UNCHANGED <<shut, stopped>>
=============================================================================
