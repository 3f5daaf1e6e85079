-------------------- MODULE MCTenancyOlderOverwrites --------------------
(* Broken variant: a late older write overwrites the newer tenant's row. *)
EXTENDS Tenancy

land_overwriting(s, v, K) ==
    /\ <<v, K>> \in transit[s]
    /\ kept' = kept \cup Preserved(s, tag[s], v)
    /\ tag' = [tag EXCEPT ![s] = v]
    /\ LandRows(s, v, K)
    /\ transit' = [transit EXCEPT ![s] = @ \ {<<v, K>>}]
    /\ arrived' = [arrived EXCEPT ![s][v] = @ \cup K]
    /\ UNCHANGED <<ver, carry, reg, rstate, want, got, rgen, pgen, pin>>
=============================================================================
