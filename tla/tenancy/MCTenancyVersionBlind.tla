-------------------- MODULE MCTenancyVersionBlind --------------------
(* Broken variant: a read returns whatever rows the pool holds, whoever wrote them. *)
EXTENDS Tenancy

ReadWrittenRow(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN KeptRows(s, v, k)
    ELSE IF row[s][k] # Absent THEN row[s][k]
    ELSE IF InTransit(s, v, k) THEN Wait
    ELSE Raised
=============================================================================
