----------------------------- MODULE TenancyTier -----------------------------
(***************************************************************************)
(* The hidden-state tier over KV-slot tenancy (contract section 4.10).     *)
(*                                                                         *)
(* Tenancy (Tenancy.tla) models one slot's tenants and delayed reads; here *)
(* a block's rows also leave the pool with its content identity (vLLM's    *)
(* block hash) and come back into whatever new slot the KV connector loads *)
(* that content into.  Rows are named by the forward that computed them:   *)
(* <<content, origin>> (origin: a unique forward), so rows of one content  *)
(* computed twice are told apart, and NoRows is the pool's zeros.          *)
(*                                                                         *)
(*  - compute(s, c):  a new tenant of slot s computes content c: its rows  *)
(*                    land (tag[s] = ver[s]);                              *)
(*  - take(s, c):     a new tenant takes s for content c and writes        *)
(*                    nothing yet (its rows are absent: the previous       *)
(*                    tenant's rows still sit in the pool);                *)
(*  - store(s):       a finished request's block goes to the tier under    *)
(*                    its content: block_rows reads the tenant's version   *)
(*                    or nothing (StoreRows);                              *)
(*  - evict(c):       the tier's LRU drops content c (byte budget) and     *)
(*                    its spill to disk fails or there is no directory:    *)
(*                    a counted loss; the older file of c is removed       *)
(*                    (StaleFile), so no older version is served;          *)
(*  - spill(c):       the LRU drops c and writes it to this tier's files;  *)
(*  - otherTier(c):   another tier (engine, restart) sharing the directory *)
(*                    spills its own rows under c's hash: this tier never  *)
(*                    reads them (SharedRead: its own namespace);          *)
(*  - load(s, c):     the connector loads content c's KV into slot s, a    *)
(*                    new tenant: restore_rows registers the tier's rows   *)
(*                    for c (memory, else this tier's file: TierGet) as the new tenant's write into s               *)
(*                    (RestoreTarget); a content the tier lacks restores   *)
(*                    nothing and vacates the slot: the new tenant wrote   *)
(*                    nothing, so its rows are absent (MissTag);           *)
(*  - a hit on s (the KV holds content cont[s]) reads the pool: the        *)
(*    tenant's rows, or Raised when absent (I6) -- ReadResult; the         *)
(*    invariants check the read a hit would make in every reachable state. *)
(*                                                                         *)
(* Code: omni_cache/runtime/tier.py HiddenTier (put/get/evict),                    *)
(* omni_cache/runtime/tier_rows.py (block_rows, restore_rows),                     *)
(* omni_cache/integration/tier_apply.py TierApplier.apply (stores, then    *)
(* loads), omni_cache/integration/kv_tier.py (which block ids and hashes). *)
(*                                                                         *)
(* Invariants: TypeOK, TierHoldsItsContent (the tier never holds another   *)
(* content's rows under a hash), HitOfItsContent (a hit is served rows of  *)
(* the content its KV holds, never another tenant's, never zeros),         *)
(* TierHitExact (a hit on restored rows gets exactly the rows the tier     *)
(* held for that content at the load), WithinBudget, TierServesOwn (the   *)
(* tier never serves rows another tier spilled), NewestPutWins (what the   *)
(* tier serves for c is the newest put's rows or nothing, across failed    *)
(* spills: never an older version).                                        *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    NumSlots,     \* KV slots (blocks)
    NumContents,  \* content identities (block hashes)
    MaxVer,       \* tenants per slot over the run
    TierCap       \* entries the tier's byte budget holds

ASSUME NumSlots \in Nat \ {0} /\ NumContents \in Nat \ {0} /\ MaxVer \in Nat \ {0}
ASSUME TierCap \in Nat

Slots    == 1..NumSlots
Contents == 1..NumContents
MaxOrigin == NumSlots * MaxVer
Foreign  == MaxOrigin + 1             \* the origin of rows another tier computed
NoRows   == <<0, 0>>                 \* zeros: rows never written
Raised   == <<-1, -1>>               \* the read raised "is not readable"
Rows     == (Contents \X (1..Foreign)) \cup {NoRows}

VARIABLES
    ver,       \* ver[s]: current tenant of slot s
    cont,      \* cont[s]: the content the KV of slot s holds now (0: none)
    pool,      \* pool[s]: the rows physically in the block pool at s
    tag,       \* tag[s]: the tenant whose write put pool[s] there (tenancy's landed version)
    tier,      \* tier[c]: the rows stored under content c, or NoRows
    from,      \* ghost: from[c] = the slot the tier's rows for c were read from
    origin,    \* forwards so far (names computed rows)
    restored,  \* ghost: restored[s] = the tier's rows for cont[s] at s's load (NoRows: not loaded)
    disk,      \* disk[c]: this tier's spilled file for c, or NoRows
    shared,    \* shared[c]: another tier's file for c in the shared directory, or NoRows
    newest     \* ghost: newest[c] = the rows of the newest put for c (NoRows: none yet)

vars == <<ver, cont, pool, tag, tier, from, origin, restored, disk, shared, newest>>

TypeOK ==
    /\ ver \in [Slots -> 0..MaxVer]
    /\ cont \in [Slots -> 0..NumContents]
    /\ pool \in [Slots -> Rows]
    /\ tag \in [Slots -> 0..MaxVer]
    /\ tier \in [Contents -> Rows]
    /\ from \in [Contents -> 0..NumSlots]
    /\ origin \in 0..MaxOrigin
    /\ restored \in [Slots -> Rows]
    /\ disk \in [Contents -> Rows]
    /\ shared \in [Contents -> Rows]
    /\ newest \in [Contents -> Rows]

Init ==
    /\ ver = [s \in Slots |-> 0]
    /\ cont = [s \in Slots |-> 0]
    /\ pool = [s \in Slots |-> NoRows]
    /\ tag = [s \in Slots |-> 0]
    /\ tier = [c \in Contents |-> NoRows]
    /\ from = [c \in Contents |-> 0]
    /\ origin = 0
    /\ restored = [s \in Slots |-> NoRows]
    /\ disk = [c \in Contents |-> NoRows]
    /\ shared = [c \in Contents |-> NoRows]
    /\ newest = [c \in Contents |-> NoRows]

Stored == {c \in Contents : tier[c] # NoRows}

\* block_rows: the tenant's rows, or nothing when the slot's tenant wrote none.
StoreRows(s) == IF tag[s] = ver[s] THEN pool[s] ELSE NoRows

\* restore_rows writes into the slot the connector loaded: the new one.
RestoreTarget(s, c) == s

\* A load the tier cannot serve: vacate_rows makes the new tenant one that
\* wrote nothing (the pool row stays the previous tenant's, now absent).
MissTag(s) == tag[s]

\* A put, or a spill that failed, removes c's older file (HiddenTier._remove_file_locked).
StaleFile(c) == NoRows

\* A tier reads only its own namespace (a subdirectory per instance): never another tier's file.
SharedRead(c) == NoRows

\* HiddenTier.get: memory, else this tier's file (read and promoted under one lock hold).
TierGet(c) == IF tier[c] # NoRows THEN tier[c]
              ELSE IF disk[c] # NoRows THEN disk[c] ELSE SharedRead(c)

compute(s, c) ==
    /\ ver[s] < MaxVer
    /\ origin' = origin + 1
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ cont' = [cont EXCEPT ![s] = c]
    /\ pool' = [pool EXCEPT ![s] = <<c, origin'>>]
    /\ tag' = [tag EXCEPT ![s] = ver'[s]]
    /\ restored' = [restored EXCEPT ![s] = NoRows]
    /\ UNCHANGED <<tier, from, disk, shared, newest>>

take(s, c) ==
    /\ ver[s] < MaxVer
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ cont' = [cont EXCEPT ![s] = c]
    /\ restored' = [restored EXCEPT ![s] = NoRows]
    /\ UNCHANGED <<pool, tag, tier, from, origin, disk, shared, newest>>

store(s) ==
    /\ cont[s] # 0
    /\ StoreRows(s) # NoRows
    /\ tier[cont[s]] # NoRows \/ Cardinality(Stored) < TierCap
    /\ tier' = [tier EXCEPT ![cont[s]] = StoreRows(s)]
    /\ from' = [from EXCEPT ![cont[s]] = s]
    /\ newest' = [newest EXCEPT ![cont[s]] = StoreRows(s)]
    /\ disk' = [disk EXCEPT ![cont[s]] = StaleFile(cont[s])]
    /\ UNCHANGED <<ver, cont, pool, tag, origin, restored, shared>>

evict(c) ==
    /\ tier[c] # NoRows
    /\ tier' = [tier EXCEPT ![c] = NoRows]
    /\ disk' = [disk EXCEPT ![c] = StaleFile(c)]
    /\ UNCHANGED <<ver, cont, pool, tag, from, origin, restored, shared, newest>>

spill(c) ==
    /\ tier[c] # NoRows
    /\ tier' = [tier EXCEPT ![c] = NoRows]
    /\ disk' = [disk EXCEPT ![c] = tier[c]]
    /\ UNCHANGED <<ver, cont, pool, tag, from, origin, restored, shared, newest>>

otherTier(c) ==
    /\ shared[c] = NoRows
    /\ shared' = [shared EXCEPT ![c] = <<c, Foreign>>]
    /\ UNCHANGED <<ver, cont, pool, tag, tier, from, origin, restored, disk, newest>>

load(s, c) ==
    /\ ver[s] < MaxVer
    /\ ver' = [ver EXCEPT ![s] = @ + 1]
    /\ cont' = [cont EXCEPT ![s] = c]
    /\ IF TierGet(c) # NoRows
          THEN /\ pool' = [pool EXCEPT ![RestoreTarget(s, c)] = TierGet(c)]
               /\ tag' = [tag EXCEPT ![s] = ver'[s]]
               /\ restored' = [restored EXCEPT ![s] = TierGet(c)]
          ELSE /\ restored' = [restored EXCEPT ![s] = NoRows]
               /\ tag' = [tag EXCEPT ![s] = MissTag(s)]
               /\ UNCHANGED pool
    /\ UNCHANGED <<tier, from, origin, disk, shared, newest>>

\* A hit on slot s reads the tenant's rows, or raises when they are absent (I6).
ReadResult(s) == IF tag[s] = ver[s] THEN pool[s] ELSE Raised

\* Every slot has had all its tenants: the run ends.
Terminating ==
    /\ \A s \in Slots : ver[s] = MaxVer
    /\ UNCHANGED vars

Next ==
    \/ \E s \in Slots : \/ store(s)
                        \/ \E c \in Contents : compute(s, c) \/ take(s, c) \/ load(s, c)
    \/ \E c \in Contents : evict(c) \/ spill(c) \/ otherTier(c)
    \/ Terminating

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TierHoldsItsContent == \A c \in Stored : tier[c][1] = c

\* A hit on any slot now is served rows of the content its KV holds (never
\* another tenant's rows, never zeros), or raises.
HitOfItsContent ==
    \A s \in Slots : (cont[s] # 0 /\ ReadResult(s) # Raised) =>
        (ReadResult(s) # NoRows /\ ReadResult(s)[1] = cont[s])

\* A hit on restored rows gets exactly the rows the tier held for the content at the load.
TierHitExact ==
    \A s \in Slots : (restored[s] # NoRows /\ ReadResult(s) # Raised) => ReadResult(s) = restored[s]

WithinBudget == Cardinality(Stored) <= TierCap

\* The tier never serves rows another tier spilled into the shared directory.
TierServesOwn == \A c \in Contents : TierGet(c) = NoRows \/ TierGet(c)[2] # Foreign

\* What the tier serves for c is exactly the newest put's rows, or nothing (never an older version).
NewestPutWins == \A c \in Contents : TierGet(c) \in {NoRows, newest[c]}
=============================================================================
