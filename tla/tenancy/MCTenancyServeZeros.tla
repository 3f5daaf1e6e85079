-------------------- MODULE MCTenancyServeZeros --------------------
(* Broken variant: a read of a key its tenant did not write returns the pool row instead of raising. *)
EXTENDS Tenancy

ReadServesZeros(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN KeptRows(s, v, k)
    ELSE IF InTransit(s, v, k) THEN Wait
    ELSE IF tag[s] = v THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
    ELSE row[s][k]
=============================================================================
