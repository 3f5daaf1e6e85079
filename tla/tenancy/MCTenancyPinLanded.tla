-------------------- MODULE MCTenancyPinLanded --------------------
(* Broken variant: a hit pins the landed version instead of the tenant's. *)
EXTENDS Tenancy

plan_landed(r, s, k) ==
    /\ rstate[r] = "idle"
    /\ Registered(s)
    /\ rstate' = [rstate EXCEPT ![r] = "planned"]
    /\ want' = [want EXCEPT ![r] = <<s, tag[s], k>>]
    /\ pgen' = [pgen EXCEPT ![r] = rgen[r]]
    /\ pin' = [pin EXCEPT ![r] = <<s, ver[s], k, k \in carry[s][ver[s]]>>]
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, kept, got, rgen, arrived>>
=============================================================================
