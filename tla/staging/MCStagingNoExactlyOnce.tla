------------------------ MODULE MCStagingNoExactlyOnce ------------------------
(***************************************************************************)
(* Broken on purpose: consume without the exactly-once check.  The pool    *)
(* trusts whatever step id the caller passes: an unconsumed id moves its   *)
(* page as usual, any other id (consumed before, or never saved) is still  *)
(* delivered.  TLC must report ExactlyOnce violated.                       *)
(***************************************************************************)
EXTENDS Staging

consume_unchecked(i) ==
    /\ delivered' = [delivered EXCEPT ![i] = @ + 1]
    /\ IF i \in unconsumed
          THEN /\ Move(at[i], "consume")
               /\ reading' = [reading EXCEPT ![at[i]] = TRUE]
               /\ unconsumed' = unconsumed \ {i}
          ELSE UNCHANGED <<page, reading, unconsumed>>
    /\ UNCHANGED <<due, at, writes, nextId, engine, mine, attempts, bad, gaveUp>>
=============================================================================
