-------------------- MODULE MCTenancyPreserveAfterLand --------------------
(* Broken variant: rows are preserved after the newer tenant's rows overwrote them. *)
EXTENDS Tenancy

PreservedTooLate(s, old, new) ==
    {[slot |-> s, ver |-> old, key |-> k, rows |-> new] :
        k \in {k2 \in Keys : /\ old # Absent /\ old # new /\ ~absent[s][k2]
                             /\ ~InTransit(s, old, k2)
                             /\ Needed(s, old, k2) /\ KeptFor(s, old, k2) = {}}}
=============================================================================
