------------------------------- MODULE Tenancy -------------------------------
(***************************************************************************)
(* KV-slot tenancy and delayed hit reads of the omni prefix cache.         *)
(*                                                                         *)
(* The block pool keeps one host row per KV slot and key.  The engine's KV *)
(* allocator hands a slot to a new tenant whenever it likes (slot reuse is *)
(* the eviction; a request id re-admitted by REPLACED is a new tenant too):*)
(* ver[s] is the slot's current tenant.  A KV slot has ONE tenant for all  *)
(* keys: a tenant's writes may carry only some keys, and once one lands,  *)
(* every key no write of it carries is absent for that slot (a hit on it   *)
(* raises "is not readable", I6/I7; it is never served from an older       *)
(* tenant's rows, which still physically sit in the pool).                 *)
(*                                                                         *)
(*  - reuse(s):       a new tenant takes KV slot s;                        *)
(*  - register(s, K): the tenant's step saved rows of keys K for s: a pool *)
(*                    write in transit (writes land in any order).  A step *)
(*                    registers up to two writes per slot, the immediate   *)
(*                    keys and the deferred keys (disjoint key sets), both *)
(*                    the same tenant: a write in transit is <<v, K>>;     *)
(*  - land(s, v, K):  the committer lands tenant v's write of keys K; rows *)
(*                    a planned read still needs are copied aside first;   *)
(*                    an older write landing late never overwrites the     *)
(*                    newer row; a key lands at most once;                 *)
(*  - plan(r, s, k):  new_step_starts registers a hit of reader r on key k *)
(*                    of slot s, pinning the version registered for (s, k);*)
(*  - read(r):        the delayed materialize reads it;                    *)
(*  - replace(r):     the reader's request id is re-admitted (REPLACED):   *)
(*                    the old admission's planned read is dropped, and the *)
(*                    new admission reads only through its own hits.       *)
(*                                                                         *)
(* The oracles read ghost history, never the implementation's variables:   *)
(* pin[r] is <<slot, the slot's tenant when the read was planned, key,     *)
(* whether that tenant had registered the key then>>, arrived[s][v] the    *)
(* keys of tenant v whose rows have landed.                                *)
(*                                                                         *)
(* Code: omni_cache/runtime/tenancy.py SlotTenancy (register, plan, land_all with  *)
(* _preserve_locked and _preserve_late_locked, read, unplan).             *)
(*                                                                         *)
(* Invariants: TypeOK, NeverSilentMiss (I6), NoStaleTenant (I7, against    *)
(* pin), HitServed (I7's preservation, against pin), NewestLanded (an      *)
(* older write never overwrites a newer tenant, against arrived), HitOwned *)
(* (a read is made by the admission that planned it), KeptNeeded,         *)
(* KeptBounded (at most one preserved version per planned read of a slot, *)
(* however many tenants overwrite it),                                    *)
(* WritesCarryKeys, EachKeyLandsOnce (a tenant's registered keys are each  *)
(* in exactly one write in transit, or landed), ReplacedIsNew.  Property   *)
(* (LiveSpec: the engine, the committer and the readers fair; the cache    *)
(* never blocks the KV allocator's reuse): EveryReaderEnds -- every reader *)
(* gets a hit to read and its delayed read ends (never waits forever).     *)
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
Writes  == Vers \X SUBSET Keys   \* a write in transit: <<tenant, its keys>>

VARIABLES
    ver,       \* ver[s]: current tenant of KV slot s (0 = never handed out)
    carry,     \* carry[s][v]: the keys tenant v registered, all its writes ({} = none; v = 0: nobody)
    reg,       \* reg[s][k]: the version registered for key k of slot s (implementation)
    tag,       \* tag[s]: the version whose write the pool row of s holds (implementation)
    absent,    \* absent[s][k]: the tenant at tag[s] did not write key k (implementation)
    row,       \* row[s][k]: whose rows physically sit in the pool at (s, k) (data)
    transit,   \* transit[s]: the writes <<v, K>> to s in transit
    kept,      \* rows copied aside for planned reads
    rstate,    \* rstate[r] \in {"idle", "planned", "done", "dropped"}
    want,      \* want[r]: <<slot, version, key>> the plan pinned (implementation)
    got,       \* got[r]: what the read returned (a version's rows, Absent, or Raised)
    rgen,      \* rgen[r]: the reader's current admission
    pgen,      \* pgen[r]: the admission that planned the read
    pin,       \* ghost: pin[r] = <<slot, tenant, key, the tenant had registered key>> at plan
    arrived    \* ghost: arrived[s][v] = the keys of tenant v whose rows have landed on s

vars == <<ver, carry, reg, tag, absent, row, transit, kept, rstate, want, got,
          rgen, pgen, pin, arrived>>

Max(S) == CHOOSE x \in S : \A y \in S : x >= y

TypeOK ==
    /\ ver \in [Slots -> 0..MaxVer]
    /\ carry \in [Slots -> [0..MaxVer -> SUBSET Keys]]
    /\ \A s \in Slots : carry[s][0] = {}       \* version 0 is nobody: it writes nothing
    /\ reg \in [Slots -> [Keys -> 0..MaxVer]]
    /\ tag \in [Slots -> 0..MaxVer]
    /\ absent \in [Slots -> [Keys -> BOOLEAN]]
    /\ row \in [Slots -> [Keys -> 0..MaxVer]]
    /\ transit \in [Slots -> SUBSET Writes]
    /\ kept \subseteq Keep
    /\ rstate \in [Readers -> {"idle", "planned", "done", "dropped"}]
    /\ want \in [Readers -> (Slots \X (0..MaxVer) \X Keys)]
    /\ got \in [Readers -> Results]
    /\ rgen \in [Readers -> 1..MaxGen]
    /\ pgen \in [Readers -> 0..MaxGen]
    /\ pin \in [Readers -> (Slots \X (0..MaxVer) \X Keys \X BOOLEAN)]
    /\ arrived \in [Slots -> [Vers -> SUBSET Keys]]

Init ==
    /\ ver = [s \in Slots |-> 0]
    /\ carry = [s \in Slots |-> [v \in 0..MaxVer |-> {}]]
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
    /\ pin = [r \in Readers |-> <<1, 0, 1, FALSE>>]
    /\ arrived = [s \in Slots |-> [v \in Vers |-> {}]]

\* Reader r has planned, and not yet read, version v of key k of slot s.
Needs(r, s, v, k) == rstate[r] = "planned" /\ want[r] = <<s, v, k>>
Needed(s, v, k) == \E r \in Readers : Needs(r, s, v, k)
KeptFor(s, v, k) == {c \in kept : c.slot = s /\ c.ver = v /\ c.key = k}

\* The slot's current tenant has registered a write.
Registered(s) == ver[s] \in Vers /\ carry[s][ver[s]] # {}

\* Key k of tenant v is in a write to s still in transit.
InTransit(s, v, k) == \E w \in transit[s] : w[1] = v /\ k \in w[2]

\* The tenants with rows landed on s.
Landed(s) == {v \in Vers : arrived[s][v] # {}}

(***************************************************************************)
(* KV allocator, engine and committer                                      *)
(***************************************************************************)
reuse(s) ==
    /\ ver[s] < MaxVer
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ UNCHANGED <<carry, reg, tag, absent, row, transit, kept, rstate, want, got,
                   rgen, pgen, pin, arrived>>

\* The tenant registers a write of keys K for slot s: from now on every key
\* of s is the tenant's (the ones no write of it carries are absent for it).
\* Its immediate and deferred writes carry disjoint keys.
RegisterVersions(s, K) == [k \in Keys |-> ver[s]]

register(s, K) ==
    /\ ver[s] # 0
    /\ K # {}
    /\ K \cap carry[s][ver[s]] = {}
    /\ carry' = [carry EXCEPT ![s][ver[s]] = @ \cup K]
    /\ reg' = [reg EXCEPT ![s] = RegisterVersions(s, K)]
    /\ transit' = [transit EXCEPT ![s] = @ \cup {<<ver[s], K>>}]
    /\ UNCHANGED <<ver, tag, absent, row, kept, rstate, want, got, rgen, pgen, pin,
                   arrived>>

\* Rows of tenant old at s that a planned read needs, copied aside before
\* tenant new's first write overwrites the row (only keys whose rows of old
\* have landed: a key of old still in transit is kept when it lands late).
Preserved(s, old, new) ==
    {[slot |-> s, ver |-> old, key |-> k, rows |-> row[s][k]] :
        k \in {k2 \in Keys : /\ old # Absent /\ old # new /\ ~absent[s][k2]
                             /\ ~InTransit(s, old, k2)
                             /\ Needed(s, old, k2) /\ KeptFor(s, old, k2) = {}}}

\* Rows of keys K of tenant v that land after a newer tenant's: kept for a
\* planned read.
PreservedLate(s, v, K) ==
    {[slot |-> s, ver |-> v, key |-> k, rows |-> v] :
        k \in {k2 \in K : Needed(s, v, k2) /\ KeptFor(s, v, k2) = {}}}

\* Tenant v's write of keys K lands: those rows are written; every key no
\* write of v carries is absent.
LandRows(s, v, K) ==
    /\ row' = [row EXCEPT ![s] = [k \in Keys |-> IF k \in K THEN v ELSE row[s][k]]]
    /\ absent' = [absent EXCEPT ![s] = [k \in Keys |-> k \notin carry[s][v]]]

\* v = tag[s]: the tenant's other write (its deferred or immediate keys).
land(s, v, K) ==
    /\ <<v, K>> \in transit[s]
    /\ IF v >= tag[s]
          THEN /\ kept' = kept \cup Preserved(s, tag[s], v)
               /\ tag' = [tag EXCEPT ![s] = v]
               /\ LandRows(s, v, K)
          ELSE /\ kept' = kept \cup PreservedLate(s, v, K)
               /\ UNCHANGED <<tag, row, absent>>
    /\ transit' = [transit EXCEPT ![s] = @ \ {<<v, K>>}]
    /\ arrived' = [arrived EXCEPT ![s][v] = @ \cup K]
    /\ UNCHANGED <<ver, carry, reg, rstate, want, got, rgen, pgen, pin>>

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
    /\ pin' = [pin EXCEPT ![r] = <<s, ver[s], k, k \in carry[s][ver[s]]>>]
    /\ UNCHANGED <<ver, carry, reg, tag, absent, row, transit, kept, got, rgen, arrived>>

\* The rows kept aside for (s, v, k); Absent (zeros) when there is no copy.
KeptRows(s, v, k) ==
    IF KeptFor(s, v, k) = {} THEN Absent ELSE (CHOOSE c \in KeptFor(s, v, k) : TRUE).rows

\* What a read of key k of version v of slot s returns now; Wait while the
\* rows it needs are still in transit.
ReadResult(s, v, k) ==
    IF KeptFor(s, v, k) # {} THEN KeptRows(s, v, k)
    ELSE IF InTransit(s, v, k) THEN Wait
    ELSE IF tag[s] = v THEN (IF absent[s][k] THEN Raised ELSE row[s][k])
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
                   arrived>>

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
                   arrived>>

Terminating ==
    /\ \A r \in Readers : rstate[r] \in {"done", "dropped"}
    /\ \A s \in Slots : transit[s] = {}
    /\ UNCHANGED vars

Next ==
    \/ \E s \in Slots : \/ reuse(s)
                        \/ \E K \in SUBSET Keys : register(s, K)
                        \/ \E v \in Vers, K \in SUBSET Keys : land(s, v, K)
    \/ \E r \in Readers : \/ read(r) \/ replace(r)
                          \/ \E s \in Slots, k \in Keys : plan(r, s, k)
    \/ Terminating

Spec == Init /\ [][Next]_vars

\* Fairness: the engine keeps running steps (the KV allocator hands slots to
\* new tenants, tenants register their writes), the committer lands them, and
\* every reader plans a hit and reads it.
Fairness ==
    /\ \A s \in Slots : /\ WF_vars(reuse(s))
                       /\ WF_vars(\E K \in SUBSET Keys : register(s, K))
                       /\ WF_vars(\E v \in Vers, K \in SUBSET Keys : land(s, v, K))
    /\ \A r \in Readers : /\ WF_vars(\E s \in Slots, k \in Keys : plan(r, s, k))
                         /\ WF_vars(read(r))

LiveSpec == Spec /\ Fairness

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
    \A r \in Readers : (rstate[r] = "done" /\ pin[r][4]) => got[r] # Raised

\* The pool row of a slot holds the newest landed tenant: a late older write
\* never overwrites a newer one.
NewestLanded ==
    \A s \in Slots : tag[s] = IF Landed(s) = {} THEN Absent ELSE Max(Landed(s))

\* Every write in transit carries at least one key (the runtime registers no
\* empty write).
WritesCarryKeys == \A s \in Slots : \A w \in transit[s] : w[2] # {}

\* Each key a tenant registered is in exactly one place: in one of its writes
\* in transit, or landed (a key lands at most once, only if registered, and
\* a registered key is never lost).
EachKeyLandsOnce ==
    \A s \in Slots, v \in Vers :
        LET parts == {w[2] : w \in {x \in transit[s] : x[1] = v}} IN
        /\ carry[s][v] = arrived[s][v] \cup UNION parts
        /\ \A K \in parts : K \cap arrived[s][v] = {}
        /\ \A K1, K2 \in parts : K1 # K2 => K1 \cap K2 = {}

\* A dropped plan belongs to an admission the REPLACED request id has left:
\* the reader is a new admission now.
ReplacedIsNew == \A r \in Readers : rstate[r] = "dropped" => pgen[r] < rgen[r]

\* Preserved rows are kept only while a planned read needs them (bounded).
KeptNeeded == \A c \in kept : Needed(c.slot, c.ver, c.key)

\* The rows kept aside for key k of slot s, and the versions the planned
\* reads of (s, k) pin.
KeptAt(s, k) == {c \in kept : c.slot = s /\ c.key = k}
PlannedVersions(s, k) ==
    {want[r][2] : r \in {q \in Readers : rstate[q] = "planned" /\ want[q][1] = s /\ want[q][3] = k}}

\* I7's bound: a (slot, key) keeps at most one preserved version per version
\* its planned reads pin (so at most one per planned read), however many
\* tenants overwrote the slot meanwhile.
KeptBounded ==
    \A s \in Slots, k \in Keys : Cardinality(KeptAt(s, k)) <= Cardinality(PlannedVersions(s, k))

\* Liveness: every reader gets a hit to read and its delayed read ends: the
\* rows it pinned land or are preserved, so it never waits forever (slot
\* reuse never waits for a read either: reuse has no guard on readers).
EveryReaderEnds == \A r \in Readers : <>(rstate[r] \in {"done", "dropped"})

\* A read is made by the admission that planned it (a REPLACED request id
\* reads only through its new admission's own hits).
HitOwned ==
    \A r \in Readers : rstate[r] = "done" => pgen[r] = rgen[r]
=============================================================================
