-------------------- MODULE MCTenancyOlderOverwrites --------------------
(* Broken variant: a late older write overwrites the newer tenant's row. *)
EXTENDS Tenancy

land_overwriting(s, v) ==
    /\ v \in transit[s]
    /\ kept' = kept \cup Preserved(s, tag[s], v)
    /\ tag' = [tag EXCEPT ![s] = v]
    /\ LandRows(s, v)
    /\ transit' = [transit EXCEPT ![s] = @ \ {v}]
    /\ landed' = [landed EXCEPT ![s] = @ \cup {v}]
    /\ UNCHANGED <<ver, carry, reg, rstate, want, got, rgen, pgen, pin, served>>
=============================================================================
