-------------------- MODULE MCTenancyVersionBlind --------------------
(* Broken variant: a read returns whatever rows the pool holds, whoever wrote them. *)
EXTENDS Tenancy

ReadWrittenRow(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN (CHOOSE c \in KeptFor(s, v, k) : TRUE).rows
    ELSE IF row[s][k] # Absent THEN row[s][k]
    ELSE IF v \in transit[s] THEN Wait
    ELSE Raised
=============================================================================
