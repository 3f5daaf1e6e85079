-------------------- MODULE MCTenancyServeZeros --------------------
(* Broken variant: a read of a key its tenant did not write returns the pool row instead of raising. *)
EXTENDS Tenancy

ReadServesZeros(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN (CHOOSE c \in KeptFor(s, v, k) : TRUE).rows
    ELSE IF tag[s] = v THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
    ELSE IF v \in transit[s] THEN (IF k \in carry[s][v] THEN Wait ELSE Raised)
    ELSE row[s][k]
=============================================================================
