------------------------------- MODULE Staging -------------------------------
(***************************************************************************)
(* The staging / step-id protocol of the omni prefix cache                 *)
(* (spec/protocol.md).                                                     *)
(*                                                                         *)
(* Processes:                                                              *)
(*  - the engine: a save claims a free page, copies into it and issues a   *)
(*    step id; a save that finds no free page waits and may raise the      *)
(*    staging timeout (or give the page back unused: abort);               *)
(*  - the builder: materializes or discards (consumes) any saved step, in  *)
(*    any order, concurrently with the engine, then stops reading the page;*)
(*  - a misbehaving caller: consumes an id twice or an id that was never   *)
(*    saved; the pool rejects the call and changes nothing;                *)
(*  - the committer: lands pool writes, each releasing its hold on a page. *)
(*                                                                         *)
(* The actions that move a page are named exactly like the triggers of     *)
(* omni_cache/runtime/states.py STAGING_TABLE (claim, abort, save, consume,        *)
(* release) and move the page only along StagingSlot!SlotEdges, so the    *)
(* action graph TLC explores can be compared with the code's table.        *)
(*                                                                         *)
(* Code: omni_cache/runtime/staging.py StagingPool.  claim/abort/save/consume are  *)
(* its methods of those names; done_reading, land (unhold) and release are *)
(* done_reading, unhold and _release_if_idle_locked; reject is consume's   *)
(* "already consumed or never saved" error; wait/timeout are the claim's   *)
(* condition-variable wait and its OmniPrefixCacheStagingTimeoutError.     *)
(*                                                                         *)
(* Invariants: TypeOK, ExactlyOnce (I1), BoundedStaging (I2),              *)
(* PageExclusive (I3), NoLostPage, OnePagePerSave, AttemptsAccounted.      *)
(* Action properties: RejectChangesNothing (I1: a rejected call changes    *)
(* nothing), RejectOnlyUnknown (only an id that is not consumable is       *)
(* rejected), TimeoutOnlyWhenFull, WaitOnlyWhenFull (I2).  Properties:    *)
(* SaveCompletes (every waiting save claims a page or raises the timeout)  *)
(* and AllSavesEnd under weak fairness of builder and committer; the       *)
(* timeout itself is NOT assumed fair, so SaveCompletes says that a live   *)
(* builder and committer alone end every wait.  MCStaging.tla's            *)
(* FailingCopiesSpec (every copy fails) checks AllSavesEnd too: a failed   *)
(* save gives its page back (abort).  Bookkeeping that no action reads     *)
(* (bad, gaveUp) is read by a property, so a lost update breaks one.      *)
(* Deadlock                                                                *)
(* checking stays on: the only state without a successor would be a stuck *)
(* one, since a finished run stutters in Terminating.                      *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, Sequences, StagingSlot

CONSTANTS
    Depth,      \* staging pages (PrefixCacheConfig.staging_depth)
    MaxSaves,   \* save attempts the engine makes; bounds the step ids
    MaxBad      \* calls the misbehaving caller makes (each must be rejected)

ASSUME Depth \in Nat \ {0} /\ MaxSaves \in Nat \ {0} /\ MaxBad \in Nat

Pages   == 1..Depth
StepIds == 1..MaxSaves
NoPage  == 0

VARIABLES
    page,        \* page[p] \in SlotStates: the staging-slot machine of page p
    reading,     \* reading[p]: a consumer still reads page p (consume .. done_reading)
    due,         \* due[p]: page p went idle; its release fires next
    at,          \* at[i]: the page step id i was saved in (NoPage until saved)
    unconsumed,  \* saved, not yet consumed step ids (the pool's step-id map)
    writes,      \* step ids whose pool write is in flight; write i holds page at[i]
    delivered,   \* delivered[i]: accepted consumes of step id i
    nextId,      \* the step id the next save issues
    engine,      \* "idle" | "waiting" | "claimed"
    mine,        \* the page the engine's current save claimed
    attempts,    \* save attempts started
    bad,         \* the step ids the misbehaving calls named, in order (each rejected)
    gaveUp       \* ghost: save attempts that ended without a step id (abort, timeout)

vars == <<page, reading, due, at, unconsumed, writes, delivered, nextId,
          engine, mine, attempts, bad, gaveUp>>

Holds(p) == {i \in writes : at[i] = p}
NoFreePage == \A p \in Pages : page[p] # "free"

\* Fire trigger t on page p: only along an edge of the slot machine.
Move(p, t) == /\ p \in Pages
              /\ CanFire(page[p], t)
              /\ page' = [page EXCEPT ![p] = After(page[p], t)]

TypeOK ==
    /\ page \in [Pages -> SlotStates]
    /\ reading \in [Pages -> BOOLEAN]
    /\ due \in [Pages -> BOOLEAN]
    /\ at \in [StepIds -> Pages \cup {NoPage}]
    /\ unconsumed \subseteq StepIds
    /\ writes \subseteq StepIds
    /\ delivered \in [StepIds -> Nat]
    /\ nextId \in 1..(MaxSaves + 1)
    /\ engine \in {"idle", "waiting", "claimed"}
    /\ mine \in Pages \cup {NoPage}
    /\ attempts \in 0..MaxSaves
    /\ bad \in Seq(StepIds) /\ Len(bad) <= MaxBad
    /\ gaveUp \in 0..MaxSaves

Init ==
    /\ page = [p \in Pages |-> "free"]
    /\ reading = [p \in Pages |-> FALSE]
    /\ due = [p \in Pages |-> FALSE]
    /\ at = [i \in StepIds |-> NoPage]
    /\ unconsumed = {}
    /\ writes = {}
    /\ delivered = [i \in StepIds |-> 0]
    /\ nextId = 1
    /\ engine = "idle"
    /\ mine = NoPage
    /\ attempts = 0
    /\ bad = <<>>
    /\ gaveUp = 0

(***************************************************************************)
(* Engine                                                                  *)
(***************************************************************************)
\* A save (new, or one that was waiting) finds page p free and claims it;
\* finding and claiming are one step under the pool lock.
claim(p) ==
    /\ engine \in {"idle", "waiting"}
    /\ engine = "idle" => attempts < MaxSaves
    /\ Move(p, "claim")
    /\ engine' = "claimed"
    /\ mine' = p
    /\ attempts' = IF engine = "idle" THEN attempts + 1 ELSE attempts
    /\ UNCHANGED <<reading, due, at, unconsumed, writes, delivered, nextId, bad, gaveUp>>

\* A save that finds no free page waits on the pool's condition variable.
wait ==
    /\ engine = "idle"
    /\ attempts < MaxSaves
    /\ NoFreePage
    /\ engine' = "waiting"
    /\ attempts' = attempts + 1
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   mine, bad, gaveUp>>

\* The wait ran out with still no free page: the save raises
\* OmniPrefixCacheStagingTimeoutError and issues no step id.
timeout ==
    /\ engine = "waiting"
    /\ NoFreePage
    /\ engine' = "idle"
    /\ gaveUp' = gaveUp + 1
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   mine, attempts, bad>>

\* The save failed after claiming (e.g. a copy error): the page goes back unused.
abort ==
    /\ engine = "claimed"
    /\ Move(mine, "abort")
    /\ engine' = "idle"
    /\ mine' = NoPage
    /\ gaveUp' = gaveUp + 1
    /\ UNCHANGED <<reading, due, at, unconsumed, writes, delivered, nextId,
                   attempts, bad>>

\* The copy is started, the step id issued and the context snapshotted; the
\* save may register a pool write that reads the page until it lands.
save ==
    /\ engine = "claimed"
    /\ Move(mine, "save")
    /\ at' = [at EXCEPT ![nextId] = mine]
    /\ unconsumed' = unconsumed \cup {nextId}
    /\ \E withWrite \in BOOLEAN :
           writes' = IF withWrite THEN writes \cup {nextId} ELSE writes
    /\ nextId' = nextId + 1
    /\ engine' = "idle"
    /\ mine' = NoPage
    /\ UNCHANGED <<reading, due, delivered, attempts, bad, gaveUp>>

(***************************************************************************)
(* Builder and misbehaving caller                                          *)
(***************************************************************************)
\* The page step id i was saved in (page 1 for an id never saved, so that an
\* action missing its guard is an invariant violation, not an index error).
PageOf(i) == IF at[i] \in Pages THEN at[i] ELSE 1

\* materialize(i) or discard_step(i) on a saved, unconsumed step id.
consume(i) ==
    /\ i \in unconsumed
    /\ Move(PageOf(i), "consume")
    /\ reading' = [reading EXCEPT ![PageOf(i)] = TRUE]
    /\ unconsumed' = unconsumed \ {i}
    /\ delivered' = [delivered EXCEPT ![i] = @ + 1]
    /\ UNCHANGED <<due, at, writes, nextId, engine, mine, attempts, bad, gaveUp>>

\* The consumer is done with the page; the page goes idle if no write holds it.
done_reading(p) ==
    /\ reading[p]
    /\ reading' = [reading EXCEPT ![p] = FALSE]
    /\ due' = [due EXCEPT ![p] = Holds(p) = {}]
    /\ UNCHANGED <<page, at, unconsumed, writes, delivered, nextId, engine, mine,
                   attempts, bad, gaveUp>>

\* A consume of an id that is not unconsumed (consumed before, or never saved)
\* raises "already consumed or never saved" and changes nothing else.
reject(i) ==
    /\ i \notin unconsumed
    /\ Len(bad) < MaxBad
    /\ bad' = Append(bad, i)
    /\ UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered, nextId,
                   engine, mine, attempts, gaveUp>>

(***************************************************************************)
(* Committer                                                               *)
(***************************************************************************)
\* Pool write i lands; the page goes idle if it was the last hold on a
\* consumed page that nobody reads any more.
land(i) ==
    /\ i \in writes
    /\ writes' = writes \ {i}
    /\ LET p == PageOf(i) IN
           due' = [due EXCEPT ![p] = @ \/ (/\ page[p] = "materialized"
                                             /\ ~reading[p]
                                             /\ Holds(p) = {i})]
    /\ UNCHANGED <<page, reading, at, unconsumed, delivered, nextId, engine, mine,
                   attempts, bad, gaveUp>>

\* The idle page is freed (same lock hold as the done_reading/land that made
\* it idle; a separate step here so that the action carries the trigger name).
release(p) ==
    /\ due[p]
    /\ Move(p, "release")
    /\ due' = [due EXCEPT ![p] = FALSE]
    /\ UNCHANGED <<reading, at, unconsumed, writes, delivered, nextId, engine, mine,
                   attempts, bad, gaveUp>>

\* Every save attempt is over and every page is free again: stutter.
Terminating ==
    /\ engine = "idle"
    /\ attempts = MaxSaves
    /\ \A p \in Pages : page[p] = "free"
    /\ UNCHANGED vars

EngineStep == (\E p \in Pages : claim(p)) \/ wait \/ timeout \/ abort \/ save
BuilderStep == (\E i \in StepIds : consume(i)) \/ (\E p \in Pages : done_reading(p))
CallerStep == \E i \in StepIds : reject(i)
CommitterStep == (\E i \in StepIds : land(i)) \/ (\E p \in Pages : release(p))

Next == EngineStep \/ BuilderStep \/ CallerStep \/ CommitterStep \/ Terminating

\* The engine claims once a page is free, waits when none is, and ends a claimed
\* save; builder and committer keep going.
\* The timeout is deliberately not fair (think of a long timeout).
EngineFair == /\ WF_vars(\E p \in Pages : claim(p))
              /\ WF_vars(wait)
              /\ WF_vars(save)
BuilderFair == /\ WF_vars(\E i \in StepIds : consume(i))
               /\ WF_vars(\E p \in Pages : done_reading(p))
CommitterFair == /\ WF_vars(\E i \in StepIds : land(i))
                 /\ WF_vars(\E p \in Pages : release(p))

Spec == Init /\ [][Next]_vars /\ EngineFair /\ BuilderFair /\ CommitterFair

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
\* I1: no step id is delivered twice, never-saved ids are never delivered,
\* and every issued id is either still unconsumed or delivered exactly once.
ExactlyOnce ==
    \A i \in StepIds :
        /\ delivered[i] <= 1
        /\ delivered[i] = 1 => i < nextId
        /\ i < nextId => ((delivered[i] = 1) = (i \notin unconsumed))

\* Each save claims exactly one page: the engine's claimed page is the only
\* claimed page, and only while its save is in progress.
OnePagePerSave ==
    /\ \A p \in Pages : page[p] = "claimed" <=> (engine = "claimed" /\ mine = p)
    /\ (mine \in Pages) = (engine = "claimed")

\* Every save attempt ends exactly one way: it issues a step id, or it gives
\* up (abort, timeout), or it is the one still in progress.
AttemptsAccounted ==
    attempts = (nextId - 1) + gaveUp + (IF engine = "idle" THEN 0 ELSE 1)

\* I3's other half: a consumed page that nobody reads and no write holds is
\* released (its release is due): no page is lost.
NoLostPage ==
    \A p \in Pages : (page[p] = "materialized" /\ ~reading[p] /\ Holds(p) = {}) => due[p]

\* I2: at most Depth unconsumed step ids.
BoundedStaging == Cardinality(unconsumed) <= Depth

\* I3: a page that may be claimed (free) or is being written (claimed) has
\* no step context, no consumer and no pool write still reading it; a saved
\* page belongs to exactly one unconsumed step id; a consumed page to none.
Owners(p) == {i \in unconsumed : at[i] = p}

PageExclusive ==
    \A p \in Pages :
        /\ page[p] \in {"free", "claimed"} =>
               /\ Holds(p) = {}
               /\ ~reading[p]
               /\ Owners(p) = {}
        /\ page[p] = "saved" => Cardinality(Owners(p)) = 1 /\ ~reading[p]
        /\ page[p] = "materialized" => Owners(p) = {}

(***************************************************************************)
(* Liveness                                                                *)
(***************************************************************************)
\* Every save that waits for a page eventually claims one or raises the
\* timeout (the engine leaves "waiting" only by claim or timeout).
SaveCompletes == (engine = "waiting") ~> (engine # "waiting")

\* The engine makes every save attempt and each one ends (claimed and saved
\* or aborted, or timed out): the protocol never gets stuck.
AllSavesEnd == <>(attempts = MaxSaves /\ engine = "idle")

(***************************************************************************)
(* Action properties                                                       *)
(***************************************************************************)
\* A rejected consume (the misbehaving caller's call) changes nothing but
\* the count of such calls.
RejectChangesNothing ==
    [][bad' # bad => UNCHANGED <<page, reading, due, at, unconsumed, writes, delivered,
                                 nextId, engine, mine, attempts, gaveUp>>]_vars

\* Only a call naming an id that is not unconsumed (consumed before, or
\* never saved) is rejected: a consumable id is never refused.
RejectOnlyUnknown ==
    [][Len(bad') > Len(bad) => bad'[Len(bad')] \notin unconsumed]_vars

\* A save waits only when no page is free (StagingPool.claim takes a free
\* page at once).
WaitOnlyWhenFull ==
    [][(engine = "idle" /\ engine' = "waiting") => NoFreePage]_vars

\* The staging timeout fires only when no page is free (a waiting save leaves
\* "waiting" by a claim, or by the timeout when every page is taken).
TimeoutOnlyWhenFull ==
    [][(engine = "waiting" /\ engine' = "idle") => NoFreePage]_vars
=============================================================================
