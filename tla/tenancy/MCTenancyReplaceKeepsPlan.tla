-------------------- MODULE MCTenancyReplaceKeepsPlan --------------------
(* Broken variant: a REPLACED request id's new admission reads the old admission's planned hit. *)
EXTENDS Tenancy

replace_keeping_plan(r) ==
    /\ rgen[r] < MaxGen
    /\ rstate[r] \in {"idle", "planned"}
    /\ rgen' = [rgen EXCEPT ![r] = @ + 1]
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, kept, rstate, want, got, pgen,
                   pin, arrived>>
=============================================================================
