-------------------- MODULE MCTenancyLandTwice --------------------
(* Broken variant: register does not require a tenant's writes to carry disjoint keys (a deferred *)
(* write repeats an immediate key), so a key of one tenant is in two writes and lands twice.      *)
EXTENDS Tenancy

register_overlapping(s, K) ==
    /\ ver[s] # 0
    /\ K # {}
    /\ carry' = [carry EXCEPT ![s][ver[s]] = @ \cup K]
    /\ reg' = [reg EXCEPT ![s] = RegisterVersions(s, K)]
    /\ transit' = [transit EXCEPT ![s] = @ \cup {<<ver[s], K>>}]
    /\ UNCHANGED <<ver, tag, absent, row, kept, rstate, want, got, rgen, pgen, pin,
                   arrived>>
=============================================================================
