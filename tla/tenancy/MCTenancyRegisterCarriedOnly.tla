-------------------- MODULE MCTenancyRegisterCarriedOnly --------------------
(* Broken variant: register bumps the version of the keys the write carries only. *)
EXTENDS Tenancy

RegisterCarried(s, K) == [k \in Keys |-> IF k \in K THEN ver[s] ELSE reg[s][k]]
=============================================================================
