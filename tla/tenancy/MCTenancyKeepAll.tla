-------------------- MODULE MCTenancyKeepAll --------------------
(* Broken variant: before a newer tenant lands, the rows of every pinned   *)
(* slot are kept, whatever version its planned reads need -- every         *)
(* overwritten version, so preserved rows grow with the number of tenants  *)
(* instead of the number of planned reads.                                 *)
EXTENDS Tenancy

\* Some planned read pins key k of slot s (at any version).
Pinned(s, k) == \E r \in Readers : rstate[r] = "planned" /\ want[r][1] = s /\ want[r][3] = k

PreserveEveryVersion(s, old, new) ==
    {[slot |-> s, ver |-> old, key |-> k, rows |-> row[s][k]] :
        k \in {k2 \in Keys : /\ old # Absent /\ old # new /\ ~absent[s][k2]
                             /\ ~InTransit(s, old, k2)
                             /\ Pinned(s, k2) /\ KeptFor(s, old, k2) = {}}}
=============================================================================
