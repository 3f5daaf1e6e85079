------------------------------- MODULE Tenancy -------------------------------
(***************************************************************************)
(* KV-slot tenancy and delayed hit reads of the omni prefix cache.         *)
(*                                                                         *)
(* The block pool keeps one host row per KV slot and key.  The engine's KV *)
(* allocator hands a slot to a new tenant whenever it likes (slot reuse is *)
(* the eviction; a request id re-admitted by REPLACED is a new tenant too):*)
(* ver[s] is the slot's current tenant.  A KV slot has ONE tenant for all  *)
(* keys: a tenant's write may carry only some keys, and when it lands,     *)
(* every key it does not carry becomes absent for that slot (a hit on it   *)
(* raises "is not readable", I6/I7; it is never served from an older       *)
(* tenant's rows, which still physically sit in the pool).                 *)
(*                                                                         *)
(*  - reuse(s):       a new tenant takes KV slot s;                        *)
(*  - register(s, K): the tenant's step saved rows of keys K for s: a pool *)
(*                    write in transit (versions land in any order);       *)
(*  - land(s, v):     the committer lands version v; rows a planned read   *)
(*                    still needs are copied aside first; an older write   *)
(*                    landing late never overwrites the newer row;         *)
(*  - plan(r, s, k):  new_step_starts registers a hit of reader r on key k *)
(*                    of slot s, pinning the version registered for (s, k);*)
(*  - read(r):        the delayed materialize reads it;                    *)
(*  - replace(r):     the reader's request id is re-admitted (REPLACED):   *)
(*                    the old admission's planned read is dropped, and the *)
(*                    new admission reads only through its own hits.       *)
(*                                                                         *)
(* The oracles read ghost history, never the implementation's variables:   *)
(* pin[r] is the slot's tenant when the read was planned, wrote[s] every   *)
(* tenant's registered keys, landed[s] every landed version.               *)
(*                                                                         *)
(* Code: omni_cache/tenancy.py SlotTenancy (register, plan, land_all with  *)
(* _preserve_locked and _preserve_late_locked, read, unplan).             *)
(*                                                                         *)
(* Invariants: TypeOK, NeverSilentMiss (I6), NoStaleTenant (I7, against    *)
(* pin), HitServed (I7's preservation, against wrote), NewestLanded (an    *)
(* older write never overwrites a newer tenant, against landed), HitOwned  *)
(* (a read is made by the admission that planned it), KeptNeeded,         *)
(* WritesCarryKeys, ReplacedIsNew.                                         *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    NumSlots,    \* KV slots
    MaxVer,      \* tenants per slot over the run
    NumKeys,     \* per-token keys (hidden and the mm keys)
    NumReaders,  \* delayed hit readers (each plans and reads once per admission)
    MaxGen       \* admissions per reader's request id (2: one REPLACED)

ASSUME NumSlots \in Nat \ {0} /\ MaxVer \in Nat \ {0} /\ NumKeys \in Nat \ {0}
ASSUME NumReaders \in Nat \ {0} /\ MaxGen \in Nat \ {0}

Slots   == 1..NumSlots
Readers == 1..NumReaders
Vers    == 1..MaxVer
Keys    == 1..NumKeys
Absent  == 0            \* rows never written (zeros)
Raised  == -1           \* the read raised OmniPrefixCacheUnmatchError ("is not readable")
Wait    == -2           \* not a result: the rows are still in transit, the read waits
Results == {Raised, Absent} \cup Vers
Keep    == [slot : Slots, ver : Vers, key : Keys, rows : {Absent} \cup Vers]

VARIABLES
    ver,       \* ver[s]: current tenant of KV slot s (0 = never handed out)
    carry,     \* carry[s][v]: the keys version v's write carries ({} = none registered)
    reg,       \* reg[s][k]: the version registered for key k of slot s (implementation)
    tag,       \* tag[s]: the version whose write the pool row of s holds (implementation)
    absent,    \* absent[s][k]: the tenant at tag[s] did not write key k (implementation)
    row,       \* row[s][k]: whose rows physically sit in the pool at (s, k) (data)
    transit,   \* transit[s]: versions whose writes to s are in transit
    kept,      \* rows copied aside for planned reads
    rstate,    \* rstate[r] \in {"idle", "planned", "done", "dropped"}
    want,      \* want[r]: <<slot, version, key>> the plan pinned (implementation)
    got,       \* got[r]: what the read returned (a version's rows, Absent, or Raised)
    rgen,      \* rgen[r]: the reader's current admission
    pgen,      \* pgen[r]: the admission that planned the read
    pin,       \* ghost: pin[r] = <<slot, tenant, key>> when the read was planned
    served,    \* ghost: served[r] = the tenant's write carried the key when planned
    landed     \* ghost: landed[s] = the versions that have landed on s

vars == <<ver, carry, reg, tag, absent, row, transit, kept, rstate, want, got,
          rgen, pgen, pin, served, landed>>

Max(S) == CHOOSE x \in S : \A y \in S : x >= y

TypeOK ==
    /\ ver \in [Slots -> 0..MaxVer]
    /\ carry \in [Slots -> [Vers -> SUBSET Keys]]
    /\ reg \in [Slots -> [Keys -> 0..MaxVer]]
    /\ tag \in [Slots -> 0..MaxVer]
    /\ absent \in [Slots -> [Keys -> BOOLEAN]]
    /\ row \in [Slots -> [Keys -> 0..MaxVer]]
    /\ transit \in [Slots -> SUBSET Vers]
    /\ kept \subseteq Keep
    /\ rstate \in [Readers -> {"idle", "planned", "done", "dropped"}]
    /\ want \in [Readers -> (Slots \X (0..MaxVer) \X Keys)]
    /\ got \in [Readers -> Results]
    /\ rgen \in [Readers -> 1..MaxGen]
    /\ pgen \in [Readers -> 0..MaxGen]
    /\ pin \in [Readers -> (Slots \X (0..MaxVer) \X Keys)]
    /\ served \in [Readers -> BOOLEAN]
    /\ landed \in [Slots -> SUBSET Vers]

Init ==
    /\ ver = [s \in Slots |-> 0]
    /\ carry = [s \in Slots |-> [v \in Vers |-> {}]]
    /\ reg = [s \in Slots |-> [k \in Keys |-> 0]]
    /\ tag = [s \in Slots |-> Absent]
    /\ absent = [s \in Slots |-> [k \in Keys |-> FALSE]]
    /\ row = [s \in Slots |-> [k \in Keys |-> Absent]]
    /\ transit = [s \in Slots |-> {}]
    /\ kept = {}
    /\ rstate = [r \in Readers |-> "idle"]
    /\ want = [r \in Readers |-> <<1, 0, 1>>]
    /\ got = [r \in Readers |-> Absent]
    /\ rgen = [r \in Readers |-> 1]
    /\ pgen = [r \in Readers |-> 0]
    /\ pin = [r \in Readers |-> <<1, 0, 1>>]
    /\ served = [r \in Readers |-> FALSE]
    /\ landed = [s \in Slots |-> {}]

\* Reader r has planned, and not yet read, version v of key k of slot s.
Needs(r, s, v, k) == rstate[r] = "planned" /\ want[r] = <<s, v, k>>
Needed(s, v, k) == \E r \in Readers : Needs(r, s, v, k)
KeptFor(s, v, k) == {c \in kept : c.slot = s /\ c.ver = v /\ c.key = k}

\* The slot's current tenant has registered its write.
Registered(s) == ver[s] \in Vers /\ carry[s][ver[s]] # {}

(***************************************************************************)
(* KV allocator, engine and committer                                      *)
(***************************************************************************)
reuse(s) ==
    /\ ver[s] < MaxVer
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ UNCHANGED <<carry, reg, tag, absent, row, transit, kept, rstate, want, got,
                   rgen, pgen, pin, served, landed>>

\* The tenant registers one write of keys K for slot s: from now on every key
\* of s is the tenant's (the ones K lacks are absent for it).
RegisterVersions(s, K) == [k \in Keys |-> ver[s]]

register(s, K) ==
    /\ ver[s] # 0
    /\ carry[s][ver[s]] = {}
    /\ K # {}
    /\ carry' = [carry EXCEPT ![s][ver[s]] = K]
    /\ reg' = [reg EXCEPT ![s] = RegisterVersions(s, K)]
    /\ transit' = [transit EXCEPT ![s] = @ \cup {ver[s]}]
    /\ UNCHANGED <<ver, tag, absent, row, kept, rstate, want, got, rgen, pgen, pin,
                   served, landed>>

\* Rows of version old at s that a planned read needs, copied aside before
\* version new overwrites the row (only keys old really wrote).
Preserved(s, old, new) ==
    {[slot |-> s, ver |-> old, key |-> k, rows |-> row[s][k]] :
        k \in {k2 \in Keys : /\ old # Absent /\ old # new /\ ~absent[s][k2]
                             /\ Needed(s, old, k2) /\ KeptFor(s, old, k2) = {}}}

\* Rows of version v that land after a newer tenant's: kept for a planned read.
PreservedLate(s, v) ==
    {[slot |-> s, ver |-> v, key |-> k, rows |-> v] :
        k \in {k2 \in carry[s][v] : Needed(s, v, k2) /\ KeptFor(s, v, k2) = {}}}

\* Version v lands: its keys' rows are written, the keys it lacks are absent.
LandRows(s, v) ==
    /\ row' = [row EXCEPT ![s] = [k \in Keys |-> IF k \in carry[s][v] THEN v ELSE row[s][k]]]
    /\ absent' = [absent EXCEPT ![s] = [k \in Keys |-> k \notin carry[s][v]]]

land(s, v) ==
    /\ v \in transit[s]
    /\ IF v > tag[s]
          THEN /\ kept' = kept \cup Preserved(s, tag[s], v)
               /\ tag' = [tag EXCEPT ![s] = v]
               /\ LandRows(s, v)
          ELSE /\ kept' = kept \cup PreservedLate(s, v)
               /\ UNCHANGED <<tag, row, absent>>
    /\ transit' = [transit EXCEPT ![s] = @ \ {v}]
    /\ landed' = [landed EXCEPT ![s] = @ \cup {v}]
    /\ UNCHANGED <<ver, carry, reg, rstate, want, got, rgen, pgen, pin, served>>

(***************************************************************************)
(* Delayed hit readers                                                     *)
(***************************************************************************)
\* A hit on key k of slot s, planned after its tenant registered (a hit
\* refers to a block its tenant computed); it pins the registered version.
plan(r, s, k) ==
    /\ rstate[r] = "idle"
    /\ Registered(s)
    /\ rstate' = [rstate EXCEPT ![r] = "planned"]
    /\ want' = [want EXCEPT ![r] = <<s, reg[s][k], k>>]
    /\ pgen' = [pgen EXCEPT ![r] = rgen[r]]
    /\ pin' = [pin EXCEPT ![r] = <<s, ver[s], k>>]
    /\ served' = [served EXCEPT ![r] = Registered(s) /\ k \in carry[s][ver[s]]]
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, kept, got, rgen, landed>>

\* What a read of key k of version v of slot s returns now; Wait while the
\* rows it needs are still in transit.
ReadResult(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN (CHOOSE c \in KeptFor(s, v, k) : TRUE).rows
    ELSE IF tag[s] = v THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
    ELSE IF v \in transit[s] THEN (IF k \in carry[s][v] THEN Wait ELSE Raised)
    ELSE Raised

\* Preserved rows that no other planned read needs any more.
StillKept(r) ==
    {c \in kept : \E q \in Readers \ {r} : Needs(q, c.slot, c.ver, c.key)}

read(r) ==
    /\ rstate[r] = "planned"
    /\ LET res == ReadResult(want[r][1], want[r][2], want[r][3]) IN
           /\ res # Wait
           /\ got' = [got EXCEPT ![r] = res]
    /\ rstate' = [rstate EXCEPT ![r] = "done"]
    /\ kept' = StillKept(r)
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, want, rgen, pgen, pin,
                   served, landed>>

\* The reader's request id is re-admitted (REPLACED): the old admission's
\* planned read is dropped (unplanned); the new admission starts idle.
replace(r) ==
    /\ rgen[r] < MaxGen
    /\ rstate[r] \in {"idle", "planned"}
    /\ rgen' = [rgen EXCEPT ![r] = @ + 1]
    /\ IF rstate[r] = "planned"
          THEN /\ rstate' = [rstate EXCEPT ![r] = "dropped"]
               /\ kept' = StillKept(r)
          ELSE UNCHANGED <<rstate, kept>>
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, want, got, pgen, pin,
                   served, landed>>

Terminating ==
    /\ \A r \in Readers : rstate[r] \in {"done", "dropped"}
    /\ \A s \in Slots : transit[s] = {}
    /\ UNCHANGED vars

Next ==
    \/ \E s \in Slots : \/ reuse(s)
                        \/ \E K \in SUBSET Keys : register(s, K)
                        \/ \E v \in Vers : land(s, v)
    \/ \E r \in Readers : \/ read(r) \/ replace(r)
                          \/ \E s \in Slots, k \in Keys : plan(r, s, k)
    \/ Terminating

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants (oracles over ghost history)                                 *)
(***************************************************************************)
\* I6: a hit never returns absent (never written) rows as data: it raises.
NeverSilentMiss ==
    \A r \in Readers : rstate[r] = "done" => got[r] # Absent

\* I7: a delayed read returns exactly the rows of the slot's tenant when the
\* read was planned -- never a newer tenant's, never an older tenant's rows
\* of a key the tenant did not write.
NoStaleTenant ==
    \A r \in Readers :
        (rstate[r] = "done" /\ got[r] \in Vers) => got[r] = pin[r][2]

\* I7 (preservation): a read whose tenant wrote its key is served, however
\* the slot was reused or the writes landed meanwhile.
HitServed ==
    \A r \in Readers : (rstate[r] = "done" /\ served[r]) => got[r] # Raised

\* The pool row of a slot holds the newest landed tenant: a late older write
\* never overwrites a newer one.
NewestLanded ==
    \A s \in Slots : tag[s] = IF landed[s] = {} THEN Absent ELSE Max(landed[s])

\* Every registered write carries at least one key (the runtime registers no
\* empty write), in transit or landed.
WritesCarryKeys ==
    \A s \in Slots, v \in Vers : (v \in transit[s] \/ v \in landed[s]) => carry[s][v] # {}

\* A dropped plan belongs to an admission the REPLACED request id has left:
\* the reader is a new admission now.
ReplacedIsNew == \A r \in Readers : rstate[r] = "dropped" => pgen[r] < rgen[r]

\* Preserved rows are kept only while a planned read needs them (bounded).
KeptNeeded == \A c \in kept : Needed(c.slot, c.ver, c.key)

\* A read is made by the admission that planned it (a REPLACED request id
\* reads only through its new admission's own hits).
HitOwned ==
    \A r \in Readers : rstate[r] = "done" => pgen[r] = rgen[r]
=============================================================================
