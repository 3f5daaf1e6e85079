------------------------ MODULE MCTenancyVersionBlind ------------------------
(***************************************************************************)
(* Broken on purpose: the read checks that the pool row was written (by    *)
(* anybody) instead of checking its version, so a slot reused by a newer  *)
(* tenant hands that tenant's rows to the delayed reader.  TLC must report *)
(* NoStaleTenant violated.                                                 *)
(***************************************************************************)
EXTENDS Tenancy

ReadWrittenRow(s, v) ==
    IF KeptFor(s, v) # {} THEN (CHOOSE k \in KeptFor(s, v) : TRUE).rows
    ELSE IF tag[s] # Absent THEN tag[s]
    ELSE IF v \in transit[s] THEN Wait
    ELSE Raised
=============================================================================
