------------------------------- MODULE Tenancy -------------------------------
(***************************************************************************)
(* KV-slot tenancy and delayed hit reads of the omni prefix cache.         *)
(*                                                                         *)
(* The block pool keeps one host row per KV slot.  The engine's KV         *)
(* allocator hands a slot to a new tenant (a new request) whenever it      *)
(* likes: slot reuse *is* the eviction.  So every slot carries a version   *)
(* (its tenant number) and every pool row a tag (the version whose rows it *)
(* holds; 0 = never written, the row reads as zeros).                      *)
(*                                                                         *)
(*  - reuse(s):    a new tenant takes KV slot s (version + 1);             *)
(*  - register(s): the current tenant's step saved rows for s: a pool      *)
(*                 write in transit.  Deferred writes stay open until      *)
(*                 their request finishes and finish/abort pushes writes   *)
(*                 to the queue's front, so several tenants' writes to one *)
(*                 slot can be in transit and land in any order;           *)
(*  - land(s, v):  the committer lands version v.  Before a newer tenant's *)
(*                 rows overwrite the row, rows that a planned read still  *)
(*                 needs are copied aside (preserved); a write older than  *)
(*                 the row's tag lands late: it never overwrites the newer *)
(*                 row, but its rows are kept if a planned read needs them;*)
(*  - plan(r, s):  new_step_starts registers a hit on slot s of its        *)
(*                 current tenant;                                         *)
(*  - read(r):     the delayed materialize (async builder) reads it: the   *)
(*                 preserved copy, else the pool row if its tag is the     *)
(*                 planned version, else waits for that version's write in *)
(*                 transit, else raises "is not readable".                 *)
(*                                                                         *)
(* Code: omni_cache/tenancy.py SlotTenancy.  A version there is the tid of *)
(* the write registered for the slot (register), a plan pins the slot at  *)
(* its registered version (plan), land preserves pinned rows before the   *)
(* index_copy_ and never lets an older tid overwrite a newer one (a late   *)
(* older write keeps its pinned rows: _preserve_late_locked), and read    *)
(* returns the pool row (landed = planned), the preserved copy (landed >   *)
(* planned), waits (NotLandedYet) or raises "is not readable".            *)
(*                                                                         *)
(* Invariants: TypeOK, NeverSilentMiss (I6), NoStaleTenant (I7), HitServed *)
(* (I7's preservation: a read whose rows were written is served).          *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    NumSlots,    \* KV slots
    MaxVer,      \* tenants per slot over the run
    NumReaders   \* delayed hit readers (each plans and reads once)

ASSUME NumSlots \in Nat \ {0} /\ MaxVer \in Nat \ {0} /\ NumReaders \in Nat \ {0}

Slots   == 1..NumSlots
Readers == 1..NumReaders
Vers    == 1..MaxVer
Absent  == 0            \* a pool row that was never written (zeros)
Raised  == -1           \* the read raised OmniPrefixCacheUnmatchError ("is not readable")
Wait    == -2           \* not a result: the rows are still in transit, the read waits
Results == {Raised, Absent} \cup Vers
Keep    == [slot : Slots, ver : Vers, rows : {Absent} \cup Vers]

VARIABLES
    ver,       \* ver[s]: current tenant of KV slot s (0 = never handed out)
    tag,       \* tag[s]: whose rows the block pool holds at s (Absent = zeros)
    transit,   \* transit[s]: versions whose writes to s are in transit
    kept,      \* rows copied aside for planned reads; rows = whose rows were copied
    rstate,    \* rstate[r] \in {"idle", "planned", "done"}
    want,      \* want[r]: <<slot, version>> the hit of reader r refers to
    avail,     \* avail[r]: its rows had landed or were in transit when planned
    got        \* got[r]: what the read returned (a version's rows, Absent, or Raised)

vars == <<ver, tag, transit, kept, rstate, want, avail, got>>

TypeOK ==
    /\ ver \in [Slots -> 0..MaxVer]
    /\ tag \in [Slots -> 0..MaxVer]
    /\ transit \in [Slots -> SUBSET Vers]
    /\ kept \subseteq Keep
    /\ rstate \in [Readers -> {"idle", "planned", "done"}]
    /\ want \in [Readers -> (Slots \X (0..MaxVer))]
    /\ avail \in [Readers -> BOOLEAN]
    /\ got \in [Readers -> Results]

Init ==
    /\ ver = [s \in Slots |-> 0]
    /\ tag = [s \in Slots |-> Absent]
    /\ transit = [s \in Slots |-> {}]
    /\ kept = {}
    /\ rstate = [r \in Readers |-> "idle"]
    /\ want = [r \in Readers |-> <<1, 0>>]
    /\ avail = [r \in Readers |-> FALSE]
    /\ got = [r \in Readers |-> Absent]

\* Reader r has planned, and not yet done, a read of version v of slot s.
Needs(r, s, v) == rstate[r] = "planned" /\ want[r] = <<s, v>>
Needed(s, v) == \E r \in Readers : Needs(r, s, v)
KeptFor(s, v) == {k \in kept : k.slot = s /\ k.ver = v}

(***************************************************************************)
(* Engine, KV allocator and committer                                      *)
(***************************************************************************)
reuse(s) ==
    /\ ver[s] < MaxVer
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ UNCHANGED <<tag, transit, kept, rstate, want, avail, got>>

register(s) ==
    /\ ver[s] # 0
    /\ ver[s] \notin transit[s]
    /\ tag[s] < ver[s]
    /\ transit' = [transit EXCEPT ![s] = @ \cup {ver[s]}]
    /\ UNCHANGED <<ver, tag, kept, rstate, want, avail, got>>

\* Rows of version old at s that a planned read needs, copied aside before
\* version new overwrites them.
Preserved(s, old, new) ==
    IF old # Absent /\ old # new /\ Needed(s, old) /\ KeptFor(s, old) = {}
       THEN {[slot |-> s, ver |-> old, rows |-> old]}
       ELSE {}

\* Rows of version v that land after a newer tenant's: kept for a planned read.
PreservedLate(s, v) ==
    IF Needed(s, v) /\ KeptFor(s, v) = {}
       THEN {[slot |-> s, ver |-> v, rows |-> v]}
       ELSE {}

land(s, v) ==
    /\ v \in transit[s]
    /\ IF v > tag[s]
          THEN /\ kept' = kept \cup Preserved(s, tag[s], v)
               /\ tag' = [tag EXCEPT ![s] = v]
          ELSE /\ kept' = kept \cup PreservedLate(s, v)
               /\ UNCHANGED tag
    /\ transit' = [transit EXCEPT ![s] = @ \ {v}]
    /\ UNCHANGED <<ver, rstate, want, avail, got>>

(***************************************************************************)
(* Delayed hit readers                                                     *)
(***************************************************************************)
plan(r, s) ==
    /\ rstate[r] = "idle"
    /\ ver[s] # 0
    /\ rstate' = [rstate EXCEPT ![r] = "planned"]
    /\ want' = [want EXCEPT ![r] = <<s, ver[s]>>]
    /\ avail' = [avail EXCEPT ![r] = (tag[s] = ver[s] \/ ver[s] \in transit[s])]
    /\ UNCHANGED <<ver, tag, transit, kept, got>>

\* What a read of version v of slot s returns right now; Wait while the
\* rows it needs are still in transit.
ReadResult(s, v) ==
    IF KeptFor(s, v) # {} THEN (CHOOSE k \in KeptFor(s, v) : TRUE).rows
    ELSE IF tag[s] = v THEN v
    ELSE IF v \in transit[s] THEN Wait
    ELSE Raised

\* After reader r is done: drop preserved rows that no planned read needs.
StillKept(r) ==
    {k \in kept : \E q \in Readers \ {r} : Needs(q, k.slot, k.ver)}

read(r) ==
    /\ rstate[r] = "planned"
    /\ LET res == ReadResult(want[r][1], want[r][2]) IN
           /\ res # Wait
           /\ got' = [got EXCEPT ![r] = res]
    /\ rstate' = [rstate EXCEPT ![r] = "done"]
    /\ kept' = StillKept(r)
    /\ UNCHANGED <<ver, tag, transit, want, avail>>

Terminating ==
    /\ \A r \in Readers : rstate[r] = "done"
    /\ \A s \in Slots : transit[s] = {}
    /\ UNCHANGED vars

Next ==
    \/ \E s \in Slots : reuse(s) \/ register(s) \/ \E v \in Vers : land(s, v)
    \/ \E r \in Readers : read(r) \/ \E s \in Slots : plan(r, s)
    \/ Terminating

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
\* I6: a hit never returns absent (never written) rows as data: it raises.
NeverSilentMiss ==
    \A r \in Readers : rstate[r] = "done" => got[r] # Absent

\* I7: a delayed read returns exactly the rows of the tenant it planned;
\* in particular never the rows of a newer tenant of a reused slot.
NoStaleTenant ==
    \A r \in Readers :
        (rstate[r] = "done" /\ got[r] \in Vers) => got[r] = want[r][2]

\* I7 (preservation): a read whose rows had landed or were in transit when it
\* was planned is served, however the slot was reused meanwhile.
HitServed ==
    \A r \in Readers : (rstate[r] = "done" /\ avail[r]) => got[r] # Raised
=============================================================================
