------------------------- MODULE MCTenancyServeZeros -------------------------
(***************************************************************************)
(* Broken on purpose: a hit whose rows are not there is served from the    *)
(* pool row anyway ("a miss reads as zeros") instead of raising.  TLC must *)
(* report NeverSilentMiss violated.                                        *)
(***************************************************************************)
EXTENDS Tenancy

ReadServesZeros(s, v) ==
    IF KeptFor(s, v) # {} THEN (CHOOSE k \in KeptFor(s, v) : TRUE).rows
    ELSE IF tag[s] = v THEN v
    ELSE IF v \in transit[s] THEN Wait
    ELSE tag[s]
=============================================================================
