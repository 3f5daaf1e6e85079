------------------------ MODULE MCStagingDoubleConsume ------------------------
(***************************************************************************)
(* Broken on purpose: consume checks that the id was ever saved instead of *)
(* that it is still unconsumed (a step-id map whose entry is never         *)
(* removed).  A never-saved id is still rejected, but a second consume of  *)
(* the same id is delivered again.  TLC must report ExactlyOnce violated.  *)
(***************************************************************************)
EXTENDS Staging

consume_ever_saved(i) ==
    /\ i < nextId
    /\ delivered' = [delivered EXCEPT ![i] = @ + 1]
    /\ IF i \in unconsumed
          THEN /\ Move(at[i], "consume")
               /\ reading' = [reading EXCEPT ![at[i]] = TRUE]
               /\ unconsumed' = unconsumed \ {i}
          ELSE UNCHANGED <<page, reading, unconsumed>>
    /\ UNCHANGED <<due, at, writes, nextId, engine, mine, attempts, bad, gaveUp>>
=============================================================================
