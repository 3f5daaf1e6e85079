-------------------- MODULE MCTenancyReadWaits --------------------
(* Broken variant: a delayed read serves only the pool row of its version; otherwise it gets     *)
(* NotLandedYet and retries (a step that changes nothing).  Once a newer tenant landed on the    *)
(* slot it retries forever: the preserved copy is never read.                                    *)
EXTENDS Tenancy

ReadWaitsForPool(s, v, k) ==
    IF tag[s] = v /\ ~InTransit(s, v, k) THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
    ELSE Wait

read_polling(r) ==
    /\ rstate[r] = "planned"
    /\ LET res == ReadResult(want[r][1], want[r][2], want[r][3]) IN
           IF res = Wait
              THEN UNCHANGED vars
              ELSE /\ got' = [got EXCEPT ![r] = res]
                   /\ rstate' = [rstate EXCEPT ![r] = "done"]
                   /\ kept' = StillKept(r)
                   /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, want, rgen, pgen,
                                  pin, arrived>>
=============================================================================
