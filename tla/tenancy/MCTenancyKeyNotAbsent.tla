-------------------- MODULE MCTenancyKeyNotAbsent --------------------
(* Broken variant: a key the new tenant's write lacks stays readable (the older tenant's rows are served). *)
EXTENDS Tenancy

LandRowsKeepingKeys(s, v, K) ==
    /\ row' = [row EXCEPT ![s] = [k \in Keys |-> IF k \in K THEN v ELSE row[s][k]]]
    /\ absent' = [absent EXCEPT ![s] = [k \in Keys |-> FALSE]]
=============================================================================
