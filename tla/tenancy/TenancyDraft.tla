----------------------------- MODULE TenancyDraft -----------------------------
(***************************************************************************)
(* Speculative decoding over KV-slot tenancy (contract section 4.14, I14): *)
(* a slot rewritten within one tenancy.                                    *)
(*                                                                         *)
(* Tenancy (Tenancy.tla) models a KV slot's tenants, one write per key     *)
(* each.  With speculative decoding one KV tenancy (a request holding the  *)
(* block) writes the same slot more than once: a verify step computes a    *)
(* row for a draft token at the slot, sampling rejects the draft, and the  *)
(* request's next step computes the slot again for the token it accepted.  *)
(* Every save is a new write with its own version (the runtime's tid and   *)
(* step id), so the rewrite is newer than the rejected write, whichever    *)
(* lands first.                                                            *)
(*                                                                         *)
(*  - reuse:          a new KV tenancy takes the slot (a block handed to   *)
(*                    another request);                                    *)
(*  - write(d):       the tenancy's step saves a row for the slot: the     *)
(*                    request's own token (d = FALSE) or a draft (d =      *)
(*                    TRUE), whose verdict is pending; a write in transit, *)
(*                    writes land in any order (deferred keys);            *)
(*  - verdict(a):     sampling accepts the draft (a) or rejects it: the    *)
(*                    verdict (trim_step) vacates the slot -- its tenant   *)
(*                    wrote no row, a hit there raises;                    *)
(*  - land(w):        the committer lands write w: a row a planned read    *)
(*                    needs is copied aside first; an older write landing  *)
(*                    late never overwrites a newer one;                   *)
(*  - plan(r):        a hit pins the slot's registered version.  The       *)
(*                    engine never plans a hit on a slot whose newest      *)
(*                    write is an unverified draft (vLLM hashes a block    *)
(*                    only for positions below the request's token count, *)
(*                    and the verdict comes before the next step); after   *)
(*                    a rejection the model trusts the engine no more: a   *)
(*                    hit may come at any time;                            *)
(*  - read(r):        the delayed materialize reads it.                    *)
(*                                                                         *)
(* The implementation's version of write w is impl[w] (w itself: a         *)
(* version per write); a broken variant keeps one version per tenancy.     *)
(* The oracles read ghost history: kind[w] (the request's row, an          *)
(* unverified draft, or rejected), data (which write's row physically      *)
(* sits in the pool), pin[r] (the newest write when r planned).            *)
(*                                                                         *)
(* Code: omni_cache/runtime/manager.py trim_step (with step_trim.trim_rows *)
(* and SlotTenancy.take_slots), SlotTenancy.register/plan/land_all/read;   *)
(* omni_cache/integration/vllm_bridge.py + spec_decode.py (the verdict).   *)
(*                                                                         *)
(* Invariants: TypeOK, NoRejectedRow (a hit never returns a rejected       *)
(* draft's row, nor an unverified one), RewriteWins (a hit returns exactly *)
(* the slot's newest write when it was planned: the rewrite, never the     *)
(* rejected write that landed late), AcceptedServed (a hit planned on an   *)
(* accepted row is served, never refused), PoolNewest (the pool row is the *)
(* newest landed write).                                                   *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    MaxWrites,   \* writes to the slot over the run (all tenancies)
    MaxTen,      \* KV tenancies of the slot over the run
    NumReaders   \* delayed hit readers (each plans and reads once)

ASSUME MaxWrites \in Nat \ {0} /\ MaxTen \in Nat \ {0} /\ NumReaders \in Nat \ {0}

Writes  == 1..MaxWrites
Readers == 1..NumReaders
None    == 0                \* no write: the pool row is zeros / the slot is vacant
Raised  == -1               \* the read raised "is not readable"
Results == {None, Raised} \cup Writes
Kinds   == {"none", "row", "draft", "rejected"}

VARIABLES
    ten,       \* the slot's current KV tenancy (0: never handed out)
    nw,        \* writes registered so far (the next write is nw + 1)
    owner,     \* owner[w]: the tenancy that made write w (ghost)
    kind,      \* kind[w]: the request's row, an unverified draft, or rejected (ghost)
    impl,      \* impl[w]: the implementation's version of write w (0: none)
    reg,       \* the newest registered write (implementation)
    vacant,    \* the slot's tenant wrote no row (a verdict vacated it; implementation)
    transit,   \* writes in transit
    tag,       \* the implementation version of the row in the pool (0: none)
    data,      \* ghost: which write's row physically sits in the pool
    kept,      \* rows copied aside for planned reads: <<version, write>>
    rstate,    \* rstate[r] \in {"idle", "planned", "done"}
    want,      \* want[r]: the version the plan pinned (0: absent)
    got,       \* got[r]: the write whose row the read returned, or None / Raised
    pin        \* ghost: pin[r] = the newest write when r planned

vars == <<ten, nw, owner, kind, impl, reg, vacant, transit, tag, data, kept,
          rstate, want, got, pin>>

\* The implementation's version of a new write (overridden by a broken variant).
NewVersion(w) == w

TypeOK ==
    /\ ten \in 0..MaxTen
    /\ nw \in 0..MaxWrites
    /\ owner \in [Writes -> 0..MaxTen]
    /\ kind \in [Writes -> Kinds]
    /\ impl \in [Writes -> 0..MaxWrites]
    /\ reg \in 0..MaxWrites
    /\ vacant \in BOOLEAN
    /\ transit \subseteq Writes
    /\ tag \in 0..MaxWrites
    /\ data \in 0..MaxWrites
    /\ kept \subseteq ((1..MaxWrites) \X Writes)
    /\ rstate \in [Readers -> {"idle", "planned", "done"}]
    /\ want \in [Readers -> 0..MaxWrites]
    /\ got \in [Readers -> Results]
    /\ pin \in [Readers -> 0..MaxWrites]

Init ==
    /\ ten = 0
    /\ nw = 0
    /\ owner = [w \in Writes |-> 0]
    /\ kind = [w \in Writes |-> "none"]
    /\ impl = [w \in Writes |-> 0]
    /\ reg = None
    /\ vacant = FALSE
    /\ transit = {}
    /\ tag = None
    /\ data = None
    /\ kept = {}
    /\ rstate = [r \in Readers |-> "idle"]
    /\ want = [r \in Readers |-> None]
    /\ got = [r \in Readers |-> None]
    /\ pin = [r \in Readers |-> None]

\* A draft whose verdict is pending (the verify step's sampling has not run yet).
Unverified == reg # None /\ kind[reg] = "draft"

\* Reader r has planned, and not yet read, version v.
Needed(v) == \E r \in Readers : rstate[r] = "planned" /\ want[r] = v
KeptFor(v) == {c \in kept : c[1] = v}

(***************************************************************************)
(* The engine (KV allocator, forward, sampling) and the committer          *)
(***************************************************************************)
reuse ==
    /\ ten < MaxTen
    /\ ~Unverified
    /\ ten' = ten + 1
    /\ UNCHANGED <<nw, owner, kind, impl, reg, vacant, transit, tag, data, kept,
                   rstate, want, got, pin>>

write(d) ==
    /\ ten # 0
    /\ nw < MaxWrites
    /\ ~Unverified                      \* the verdict comes before the next step
    /\ LET w == nw + 1 IN
        /\ nw' = w
        /\ owner' = [owner EXCEPT ![w] = ten]
        /\ kind' = [kind EXCEPT ![w] = IF d THEN "draft" ELSE "row"]
        /\ impl' = [impl EXCEPT ![w] = NewVersion(w)]
        /\ reg' = w
        /\ vacant' = FALSE
        /\ transit' = transit \cup {w}
    /\ UNCHANGED <<ten, tag, data, kept, rstate, want, got, pin>>

\* Whether the verdict vacates the slot: exactly when it rejects the draft
\* (trim_step cuts and vacates the rejected rows, never a kept one).
VacateOn(a) == ~a

verdict(a) ==
    /\ Unverified
    /\ kind' = [kind EXCEPT ![reg] = IF a THEN "row" ELSE "rejected"]
    /\ vacant' = VacateOn(a)
    /\ UNCHANGED <<ten, nw, owner, impl, reg, transit, tag, data, kept, rstate, want, got, pin>>

\* Write w lands: a newer (or equal) version overwrites the pool row, after
\* the row a planned read needs is copied aside; an older one landing late
\* is kept only for a planned read of its version.
land(w) ==
    /\ w \in transit
    /\ IF impl[w] >= tag
          THEN /\ kept' = kept \cup (IF tag # None /\ Needed(tag) /\ KeptFor(tag) = {}
                                      THEN {<<tag, data>>} ELSE {})
               /\ tag' = impl[w]
               /\ data' = w
          ELSE /\ kept' = kept \cup (IF Needed(impl[w]) /\ KeptFor(impl[w]) = {}
                                      THEN {<<impl[w], w>>} ELSE {})
               /\ UNCHANGED <<tag, data>>
    /\ transit' = transit \ {w}
    /\ UNCHANGED <<ten, nw, owner, kind, impl, reg, vacant, rstate, want, got, pin>>

(***************************************************************************)
(* Delayed hit readers                                                     *)
(***************************************************************************)
plan(r) ==
    /\ rstate[r] = "idle"
    /\ reg # None
    /\ ~Unverified
    /\ rstate' = [rstate EXCEPT ![r] = "planned"]
    /\ want' = [want EXCEPT ![r] = IF vacant THEN None ELSE impl[reg]]
    /\ pin' = [pin EXCEPT ![r] = reg]
    /\ UNCHANGED <<ten, nw, owner, kind, impl, reg, vacant, transit, tag, data, kept, got>>

\* Some write of version v still in transit.
InTransit(v) == \E w \in transit : impl[w] = v

\* What a read of version v returns now (the write whose row it serves);
\* -2: the rows are in transit, the read waits.
ReadResult(v) ==
    IF v = None THEN Raised
    ELSE IF KeptFor(v) # {} THEN (CHOOSE c \in KeptFor(v) : TRUE)[2]
    ELSE IF InTransit(v) /\ tag < v THEN -2
    ELSE IF tag = v THEN data
    ELSE IF InTransit(v) THEN -2
    ELSE Raised

read(r) ==
    /\ rstate[r] = "planned"
    /\ LET res == ReadResult(want[r]) IN
           /\ res # -2
           /\ got' = [got EXCEPT ![r] = res]
    /\ rstate' = [rstate EXCEPT ![r] = "done"]
    /\ kept' = {c \in kept : \E q \in Readers \ {r} : rstate[q] = "planned" /\ want[q] = c[1]}
    /\ UNCHANGED <<ten, nw, owner, kind, impl, reg, vacant, transit, tag, data, want, pin>>

Terminating ==
    /\ \A r \in Readers : rstate[r] = "done"
    /\ transit = {}
    /\ UNCHANGED vars

Next ==
    \/ reuse
    \/ \E d \in BOOLEAN : write(d)
    \/ \E a \in BOOLEAN : verdict(a)
    \/ \E w \in Writes : land(w)
    \/ \E r \in Readers : plan(r) \/ read(r)
    \/ Terminating

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants (oracles over ghost history)                                 *)
(***************************************************************************)
\* I14: a hit never returns a rejected draft's row, nor a draft whose
\* verdict is pending.
NoRejectedRow ==
    \A r \in Readers : (rstate[r] = "done" /\ got[r] \in Writes) => kind[got[r]] = "row"

\* I14 with I7: a hit returns exactly the slot's newest write when it was
\* planned -- after a rewrite within one tenancy, the rewrite, never the
\* tenancy's earlier (rejected) write, whichever landed first.
RewriteWins ==
    \A r \in Readers : (rstate[r] = "done" /\ got[r] \in Writes) => got[r] = pin[r]

\* A hit planned on the request's own row is served, never refused (the
\* vacate refuses only a rejected draft's slot).
AcceptedServed ==
    \A r \in Readers : (rstate[r] = "done" /\ pin[r] # None /\ kind[pin[r]] = "row") => got[r] # Raised

\* The pool row is the newest write that landed.
Landed == {w \in Writes : w <= nw /\ w \notin transit}
PoolNewest == data = IF Landed = {} THEN None ELSE CHOOSE w \in Landed : \A x \in Landed : x <= w
=============================================================================
