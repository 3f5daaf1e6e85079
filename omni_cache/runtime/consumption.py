"""The consumer's half of the per-step protocol: each saved step id consumed exactly once.

Owns: ``StepConsumption``, the step contexts of saved, unconsumed step ids (put there by the
save, under the manager's state lock, before the staging save makes the id consumable) and the
step ids a call is consuming now; ``materialize``, ``discard`` and a verify step's ``trim``.
Its state is guarded by the manager's state lock, which it shares (``OwnedLock``); the
manager's ``count_locked`` counts consumptions and trimmed rows (state lock held), its
``vacate`` gives the KV slots of trimmed rows a new tenant. The manager checks that it is
usable before each call (I8, shutdown) and delegates.

Upholds: I1 (a context is taken by one call at a time and leaves before the staging consume,
so a second consumer racing the first is refused, and a refused consume gives the context
back: the step stays unconsumed with it; a call naming requests outside the step is refused
before it takes the context, so it never turns a valid consumer away), I4 (materialize names only
the step's own requests; the rows come from the context's snapshot through ``StepReader``), I14 (a verdict trims a
context only while no consumer holds it, and the cut rows' KV slots are vacated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from omni_cache.runtime.errors import PHRASE_NOT_SAVED, PHRASE_OUTSIDE_SNAPSHOT, OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import StepRows
from omni_cache.runtime.interface import ReqId, StageCacheOutputs, StepId
from omni_cache.runtime.locks import OwnedLock
from omni_cache.runtime.reader import StepReader
from omni_cache.runtime.staging import StagingPool
from omni_cache.runtime.step_outputs import StepContext
from omni_cache.runtime.step_trim import trim_rows


def _same_ids(given: tuple[Any, ...], saved: tuple[ReqId, ...]) -> bool:
    """``given == saved``; False where an element cannot be compared to a request id (an array's
    ``==`` has no truth value): such an id is no request of the step, and is named as outside it."""
    try:
        return given == saved
    except (TypeError, ValueError):
        return False


def _is_step_id(step_id: Any) -> bool:
    """Only a real int is an id (True == 1 would find step 1's context)."""
    return isinstance(step_id, int) and not isinstance(step_id, bool)


class StepConsumption:
    """Step contexts and their single consumers; one per manager."""

    def __init__(self, *, lock: OwnedLock, staging: StagingPool, reader: StepReader,
                 count_locked: Callable[[str, int], None], vacate: Callable[[np.ndarray], Any]) -> None:
        self.staging = staging
        self.reader = reader
        self._lock = lock
        self._count_locked = count_locked
        self._vacate = vacate
        # ---- guarded by _lock ----
        self._contexts: dict[StepId, StepContext] = {}
        self._consuming: set[StepId] = set()  # step ids whose context a materialize/discard holds

    # ---- the save's side (state lock held) ------------------------------------
    def put_locked(self, ctx: StepContext) -> None:
        """A saved step's context, in place before its id becomes consumable (I1)."""
        self._contexts[ctx.step_id] = ctx

    def drop_locked(self, step_id: StepId) -> None:
        """The context of a save that failed before its id was handed out."""
        self._contexts.pop(step_id, None)

    # ---- consumers ------------------------------------------------------------
    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> StageCacheOutputs:
        """Per request: cached prefix rows then this step's rows (consumes the step id once)."""
        try:
            req_ids = tuple(req_ids)  # a tuple passes through as itself: no per-request copy
        except TypeError as exc:
            raise OmniPrefixCacheUnmatchError(
                f"materialize step {step_id}: req_ids must be a sequence of request ids, got {req_ids!r}; "
                "nothing was consumed (I4)") from exc
        # NOTE: the context leaves ``_contexts`` before the consume and comes back only if this call
        # is refused, so a verdict (``trim``) racing this read is refused instead of changing
        # the rows while they are read, and a second consumer racing this one is refused (I1).
        ctx = self._take(step_id, "materialize", req_ids)
        try:
            slot = self.staging.consume(step_id, caller="materialize")
        except BaseException:
            self._end(step_id, ctx, consumed=None)  # refused: the step stays unconsumed, its context with it
            raise
        assert ctx is not None, f"step {step_id} consumed without a context: manager bug"
        self._end(step_id, ctx, consumed="materialized")
        try:
            return self.reader.build_outputs(ctx, req_ids)
        finally:
            self.reader.release(ctx, slot)

    def discard(self, step_id: StepId) -> None:
        """Consume ``step_id`` without building outputs."""
        ctx = self._take(step_id, "discard_step")
        try:
            slot = self.staging.consume(step_id, caller="discard_step")
        except BaseException:
            self._end(step_id, ctx, consumed=None)
            raise
        assert ctx is not None, f"step {step_id} consumed without a context: manager bug"
        self._end(step_id, ctx, consumed="discarded")
        self.reader.release(ctx, slot)

    def trim(self, step_id: StepId, keep: Mapping[ReqId, int]) -> None:
        """A verify step's verdict before its id is handed on: request ``r`` keeps its first
        ``keep[r]`` rows of the step, the rest are never materialized and their KV slots are
        vacated (I14). A refusal changes nothing."""
        # NOTE: the cut is computed outside the lock (it runs the caller's keys and counts) from
        # the rows it replaces, and lands only if those are still the step's: a second verdict
        # racing this one is worked out again from what the first kept (a trim only cuts more, I14).
        while True:
            with self._lock:
                ctx = self._contexts.get(step_id) if _is_step_id(step_id) else None
            if ctx is None:
                raise OmniPrefixCacheUnmatchError(
                    f"trim_step: step {step_id!r} was {PHRASE_NOT_SAVED} by this manager (or a consumer is "
                    "consuming it: a verdict must come before the step id is handed on); nothing was trimmed (I1)")
            rows = ctx.rows
            if (trimmed := trim_rows(rows, keep, what=f"trim_step {step_id} (saved at {ctx.saved_at})")) is None:
                return
            with self._lock:
                if self._contexts.get(step_id) is ctx and ctx.rows is rows:
                    ctx.rows, dropped = trimmed
                    self._count_locked("trimmed_rows", len(dropped))
                    break
        self._vacate(ctx.slots_np[dropped])

    # ---- internals ------------------------------------------------------------
    def _take(self, step_id: Any, caller: str, req_ids: tuple[Any, ...] | None = None) -> StepContext | None:
        """Take the context of ``step_id`` for this call, which alone may then consume it (I1). None
        when it has none (not an int id, never saved, or consumed: the staging consume refuses it);
        refused while another call holds it (that call consumes it, or gives it back if refused).
        ``req_ids`` (materialize's) must be the step's requests: checked before the context is
        taken, so a call refused for them never turns a valid consumer away."""
        if not _is_step_id(step_id):
            return None
        while True:
            with self._lock:
                ctx = self._contexts.get(step_id)
                if ctx is None:
                    if step_id in self._consuming:
                        raise OmniPrefixCacheUnmatchError(
                            f"{caller}: step id {step_id} was {PHRASE_NOT_SAVED}: another call is consuming it; "
                            "nothing was consumed (I1)")
                    return None
                rows = ctx.rows
                if req_ids is None or req_ids is rows.req_ids:
                    return self._take_locked(step_id, ctx)
            # NOTE: compared outside the lock (the ids' own ``==`` and hashes are the caller's code),
            # then taken only if the step still has these rows; else looked at again.
            if not _same_ids(req_ids, rows.req_ids):  # the usual call: every request, in order
                self._check_req_ids(step_id, ctx, rows, req_ids)
            with self._lock:
                if self._contexts.get(step_id) is ctx and ctx.rows is rows:
                    return self._take_locked(step_id, ctx)

    def _take_locked(self, step_id: StepId, ctx: StepContext) -> StepContext:
        """The context leaves ``_contexts`` for this call alone (I1). Caller holds the state lock."""
        del self._contexts[step_id]
        self._consuming.add(step_id)
        return ctx

    @staticmethod
    def _check_req_ids(step_id: StepId, ctx: StepContext, rows: StepRows, req_ids: tuple[Any, ...]) -> None:
        """Refuse requests that are not the step's (I4): those ``rows`` (the context's, as compared) hold."""
        if outside := [r for r in req_ids if rows.write_of(r) is None]:
            raise OmniPrefixCacheUnmatchError(
                f"materialize step {step_id}: requests {outside} are {PHRASE_OUTSIDE_SNAPSHOT} (saved at "
                f"{ctx.saved_at} with requests {list(rows.req_ids)} in row order); nothing was consumed (I4)")

    def _end(self, step_id: Any, ctx: StepContext | None, *, consumed: str | None) -> None:
        """The call that took ``ctx`` is past its consume: count it (``consumed``: the counter), or,
        refused (None), give the context back so the step stays unconsumed with it."""
        if ctx is None:
            return
        with self._lock:
            self._consuming.discard(step_id)
            if consumed is None:
                self._contexts[step_id] = ctx
            else:
                self._count_locked(consumed, 1)
