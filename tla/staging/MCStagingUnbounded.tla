-------------------------- MODULE MCStagingUnbounded --------------------------
(***************************************************************************)
(* Broken on purpose: claim without bound.  A save that finds no free page *)
(* does not wait: it stages the step in a fresh heap buffer (no page) and  *)
(* issues the step id anyway.  Pages stay exclusive, but the number of     *)
(* unconsumed step ids (and host memory) grows past Depth.  TLC must       *)
(* report BoundedStaging violated.                                         *)
(***************************************************************************)
EXTENDS Staging

save_overflow ==
    /\ engine = "idle"
    /\ attempts < MaxSaves
    /\ NoFreePage
    /\ unconsumed' = unconsumed \cup {nextId}
    /\ nextId' = nextId + 1
    /\ attempts' = attempts + 1
    /\ UNCHANGED <<page, reading, due, at, writes, delivered, engine, mine, bad, gaveUp>>

\* Consuming an overflow step frees its buffer; a paged step as usual.
consume_or_overflow(i) ==
    /\ i \in unconsumed
    /\ unconsumed' = unconsumed \ {i}
    /\ delivered' = [delivered EXCEPT ![i] = @ + 1]
    /\ IF at[i] = NoPage
          THEN UNCHANGED <<page, reading>>
          ELSE /\ Move(at[i], "consume")
               /\ reading' = [reading EXCEPT ![at[i]] = TRUE]
    /\ UNCHANGED <<due, at, writes, nextId, engine, mine, attempts, bad, gaveUp>>

OverflowEngineStep ==
    (\E p \in Pages : claim(p)) \/ save_overflow \/ timeout \/ abort \/ save
=============================================================================
