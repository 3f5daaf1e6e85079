-------------------- MODULE MCTenancyReadWaits --------------------
(* Broken variant: a delayed read returns only the pool row of its version and waits otherwise:   *)
(* once a newer tenant landed on the slot it waits forever (the preserved copy is never read).    *)
EXTENDS Tenancy

ReadWaitsForPool(s, v, k) ==
    IF tag[s] = v /\ ~InTransit(s, v, k) THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
    ELSE Wait
=============================================================================
