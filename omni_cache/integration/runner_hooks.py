"""Hooks a vLLM-style model runner calls to feed the omni prefix cache.

Owns: ``PrefixCacheRunnerHooks`` -- the frozen ``ModelCachePolicy``, the
lazily built ``OmniPrefixCacheManager`` (on the output rank only: TP rank 0 of
the last pipeline stage, see ``omni_cache.integration.ranks``; every other rank's
hooks allocate nothing and do nothing), the
scheduler adapter, this step's scheduled-token counts between ``begin_step``
and ``after_forward``, the save-time request ids of every unconsumed step, and
the requests withheld after a failed KV load (``withhold_failed_loads``: their
rows of that step are never served; their next EXTENDED event becomes RESUMED
on their prefix's blocks, the hit vLLM cut to before the first failed block).

Call order (spec/protocol.md), all on the engine thread except the output path:

1. ``on_model_loaded(model)`` -- freeze ``ModelCachePolicy.from_model(model)``.
2. ``on_kv_cache_initialized(vllm_config, kv_cache_config)`` -- the config gate
   (or ``configure(PrefixCacheConfig | None)``).
3. ``begin_step(scheduler_output)`` -- at the top of ``execute_model``, before
   ``_update_states`` drops finished requests: build the manager if needed,
   translate, ``new_step_starts``.
4. ``after_forward(hidden, mm, view=..., num_tokens_unpadded=...,
   num_tokens_padded=...)`` -- build the write layout, ``save_outputs``;
   returns the step id to attach to the step's output.
5. ``materialize(step_id)`` (uses the save-time request ids) or
   ``discard(step_id)`` when the payload is built from live outputs or on error;
   ``build_payload`` does either and discards on a failed materialize.

Warmup and dummy runs are never fed: pass ``is_dummy=True`` (both calls then
do nothing and return ``None``). Upholds I1 (one consume per step id: the
save-time ids are popped once) and I4 (materialize asks for exactly the
save-time requests); the rest is the manager's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from omni_cache.integration.adapter import PrefixCacheSchedulerAdapter
from omni_cache.integration.config_gate import stage_prefix_cache_config
from omni_cache.integration.ranks import WorkerRank, cache_bytes, vllm_worker_rank
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.events import PrefixCacheEventKind, PrefixCacheStep, PrefixCacheWriteLayout
from omni_cache.runtime.interface import ModelCachePolicy, PrefixCacheConfig, ReqId, StageCacheOutputs, StepId

if TYPE_CHECKING:
    from omni_cache.runtime.manager import OmniPrefixCacheManager

__all__ = ["PrefixCacheRunnerHooks", "vllm_is_last_pp_rank"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def vllm_is_last_pp_rank() -> bool:
    """vLLM's ``get_pp_group().is_last_rank``; True when vLLM is not installed
    or its distributed state is not initialized (single process)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group
    except ImportError:
        return True
    try:
        return bool(get_pp_group().is_last_rank)
    except AssertionError:  # pipeline-parallel group not initialized
        return True


def _default_manager_factory(config: PrefixCacheConfig, **kwargs: Any) -> OmniPrefixCacheManager:
    from omni_cache.runtime.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(config, **kwargs)


class PrefixCacheRunnerHooks:
    """The per-step calls of one engine stage (see the module docstring).

    Which rank holds the cache is decided once, at the first real step:
    ``is_last_pp_rank`` (a bool or a callable; a single TP rank per stage is
    assumed) when given, else ``rank`` (a ``WorkerRank`` or a callable
    returning one; ``None``: ``vllm_worker_rank``), whose output rank holds it
    (with ``all_tp_ranks``, every TP rank of the last stage). ``manager_kwargs``
    go to the manager (``eager``, ``recorder``, ``faults``).
    """

    def __init__(
        self,
        config: PrefixCacheConfig | None = None,
        *,
        is_last_pp_rank: bool | Callable[[], bool] | None = None,
        rank: WorkerRank | Callable[[], WorkerRank] | None = None,
        all_tp_ranks: bool = False,
        manager_factory: Callable[..., Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        self._config = config
        self._configured = config is not None
        self._is_last_pp_rank = is_last_pp_rank
        self._rank_source = rank
        self.all_tp_ranks = bool(all_tp_ranks)
        self._rank: WorkerRank | None = None  # set once by _holds_cache (engine thread)
        self._last_rank: bool | None = None  # whether this rank holds the cache; set once by _holds_cache
        self._factory = manager_factory or _default_manager_factory
        self._manager_kwargs = manager_kwargs
        self._policy: ModelCachePolicy | None = None
        self._manager: Any = None
        self.adapter = PrefixCacheSchedulerAdapter()
        self._step_scheduled: dict[ReqId, int] | None = None
        self._lock = threading.Lock()  # guards _save_req_ids (output path may be another thread)
        self._save_req_ids: dict[StepId, tuple[ReqId, ...]] = {}
        # Requests withheld after a failed KV load -> their prefix's block ids (output group), until
        # their next event: vLLM recomputes from its first failed block, which is their new hit.
        self._reloads: dict[ReqId, tuple[int, ...]] = {}
        self.reloaded_req_ids: frozenset[ReqId] = frozenset()  # this step's such RESUMED events

    # ------------------------------------------------------------- set-up
    def on_model_loaded(self, model: Any) -> ModelCachePolicy:
        """Freeze the model's cache policy; a second, different policy raises."""
        policy = ModelCachePolicy.from_model(model)
        if self._policy is not None and policy != self._policy:
            raise OmniPrefixCacheUnmatchError(
                f"PrefixCacheRunnerHooks: the cache policy is frozen at model load ({self._policy}); "
                f"a second model load produced {policy}"
            )
        self._policy = policy
        return policy

    def on_kv_cache_initialized(self, vllm_config: Any, kv_cache_config: Any) -> PrefixCacheConfig | None:
        """Run the configuration gate; ``None`` turns the hooks into no-ops."""
        self.configure(stage_prefix_cache_config(vllm_config, kv_cache_config))
        return self._config

    def configure(self, config: PrefixCacheConfig | None) -> None:
        if self._manager is not None:
            raise OmniPrefixCacheUnmatchError(
                "PrefixCacheRunnerHooks.configure: the manager is already running; the KV cache "
                "cannot be re-sized under it"
            )
        self._config = config
        self._configured = True

    @property
    def policy(self) -> ModelCachePolicy | None:
        return self._policy

    @property
    def config(self) -> PrefixCacheConfig | None:
        return self._config

    @property
    def manager(self) -> Any:
        """The manager, or ``None`` before the first real step / when disabled."""
        return self._manager

    def _active(self) -> bool:
        """Whether real steps feed the cache; builds the manager on first use."""
        if self._manager is not None:
            return True
        if not self._configured:
            raise OmniPrefixCacheUnmatchError(
                "PrefixCacheRunnerHooks: a real step started before the KV cache was initialized; "
                "call on_kv_cache_initialized(...) (or configure(...)) first"
            )
        if self._config is None:
            return False
        if not self._holds_cache():
            return False
        if self._policy is None:
            raise OmniPrefixCacheUnmatchError(
                "PrefixCacheRunnerHooks: a real step started before the model was loaded; call "
                "on_model_loaded(model) first so the cache policy is frozen"
            )
        manager = self._factory(self._config, **self._manager_kwargs)
        manager.register_policy(self._policy)
        self._manager = manager
        return True

    def _holds_cache(self) -> bool:
        if self._last_rank is None:
            flag = self._is_last_pp_rank
            if flag is not None:
                self._last_rank = bool(flag() if callable(flag) else flag)
            else:
                self._rank = self._resolve_rank()
                self._last_rank = self._rank.holds_cache(all_tp_ranks=self.all_tp_ranks)
        return self._last_rank

    def rank_stats(self) -> dict[str, Any]:
        """This rank's place, whether it holds the cache and the host bytes the
        cache holds here (zero on a rank without one)."""
        rank = self._rank
        if rank is None and self._is_last_pp_rank is None:
            rank = self._resolve_rank()
        return {**(rank.as_dict() if rank is not None else {}), "holds_cache": self._manager is not None,
                **cache_bytes(self._manager)}

    def stats(self) -> dict[str, Any]:
        """``rank_stats()`` plus the manager's own ``stats()`` (``None`` on a rank without a cache)."""
        return {**self.rank_stats(), "manager": self._manager.stats() if self._manager is not None else None}

    def _resolve_rank(self) -> WorkerRank:
        source = self._rank_source if self._rank_source is not None else vllm_worker_rank
        rank = source() if callable(source) else source
        if not isinstance(rank, WorkerRank):
            raise TypeError(f"PrefixCacheRunnerHooks: rank must be a WorkerRank, got {type(rank).__name__}")
        return rank

    # ------------------------------------------------------------- per step
    def begin_step(self, scheduler_output: Any, *, is_dummy: bool = False) -> PrefixCacheStep | None:
        """Top of ``execute_model``, before finished requests are dropped."""
        if is_dummy or not self._active():
            return None
        step = self.adapter.translate_step(scheduler_output)
        self.reloaded_req_ids = frozenset()
        if self._reloads:
            step = self._resume_reloads(step)
        self._step_scheduled = None
        self._manager.new_step_starts(step)
        self._step_scheduled = dict(step.scheduled_tokens)
        return step

    def after_forward(
        self,
        hidden_states: Any,
        mm_outputs: dict[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        view: Any = None,
        write_layout: PrefixCacheWriteLayout | None = None,
        num_scheduled_tokens: Any = None,
        is_dummy: bool = False,
    ) -> StepId | None:
        """Save this step's outputs; returns the step id (``None`` when not fed).

        The layout is ``write_layout`` or is built from ``view`` (a
        ``BlockTableView`` built after ``_update_states``) and this step's
        scheduled tokens (``num_scheduled_tokens``, default: from
        ``begin_step``).
        """
        if is_dummy or self._manager is None:
            return None
        scheduled = self._step_scheduled
        self._step_scheduled = None
        if scheduled is None:
            raise OmniPrefixCacheUnmatchError(
                "PrefixCacheRunnerHooks.after_forward: no begin_step for this step (a dummy or warmup "
                "run must pass is_dummy=True to both calls)"
            )
        if write_layout is None:
            if view is None:
                raise ValueError("PrefixCacheRunnerHooks.after_forward: pass view= or write_layout=")
            counts = scheduled if num_scheduled_tokens is None else num_scheduled_tokens
            write_layout = self.adapter.build_write_layout(view, num_scheduled_tokens=counts)
        step_id = self._manager.save_outputs(
            hidden_states,
            dict(mm_outputs or {}),
            num_tokens_unpadded=num_tokens_unpadded,
            num_tokens_padded=num_tokens_padded,
            write_layout=write_layout,
        )
        with self._lock:
            self._save_req_ids[step_id] = write_layout.req_ids
        return step_id

    # ------------------------------------------------------------- output path
    def save_time_req_ids(self, step_id: StepId) -> tuple[ReqId, ...] | None:
        with self._lock:
            return self._save_req_ids.get(step_id)

    def take_save_time_req_ids(self, step_id: StepId) -> tuple[ReqId, ...] | None:
        """Forget ``step_id``'s save-time request ids (a consumer that consumes the step on the
        manager itself, not through ``materialize``/``discard``); returns them."""
        with self._lock:
            return self._save_req_ids.pop(step_id, None)

    def withhold_failed_loads(self, step_id: StepId, view: Any, spans: tuple[tuple[ReqId, int, int], ...],
                              failed_blocks: set[int], engine_step: int) -> dict[ReqId, tuple[int, ...]]:
        """``withhold`` the requests of ``spans`` whose cached prefix ``[0, start)`` (``view``: a
        ``BlockTableView``) holds one of ``failed_blocks`` -- blocks whose KV load failed this step
        (the tier could not restore their rows: vLLM recomputes or fails those requests, so their rows
        of this step, computed over KV that never came, are not served, and their hit would read the
        vacated block: "is not readable"). Returns them with their prefix's block ids."""
        bs = self._require_manager().config.block_size
        withheld: dict[ReqId, tuple[int, ...]] = {}
        for rid, start, _ in spans:
            if start:
                blocks = tuple(int(b) for b in view.slots_for_spans([(rid, 0, start)])[::bs] // bs)
                if not failed_blocks.isdisjoint(blocks):
                    log.warning("omni-cache: engine step %d: request %s reads a block whose KV load failed; "
                                "its rows of this step are not served (vLLM recomputes or fails it)", engine_step, rid)
                    withheld[rid] = blocks
        if withheld:
            self.withhold(step_id, withheld)
        return withheld

    def withhold(self, step_id: StepId, prefixes: dict[ReqId, tuple[int, ...]]) -> None:
        """Leave the requests of ``prefixes`` (id -> the block ids of its cached prefix) out of
        ``step_id``'s save-time requests: a KV load of theirs failed this step, so vLLM fails them or
        recomputes them from the first failed block. Their next event (EXTENDED, with the cut
        ``num_computed_tokens``) becomes RESUMED on those blocks: the cut prefix is their new hit."""
        with self._lock:
            kept = self._save_req_ids.get(step_id)
            if kept is not None:
                self._save_req_ids[step_id] = tuple(r for r in kept if r not in prefixes)
        self._reloads.update(prefixes)

    def _resume_reloads(self, step: PrefixCacheStep) -> PrefixCacheStep:
        events = []
        config = self._manager.config if self._manager is not None else None
        bs, group = (config.block_size, config.output_group_id) if config is not None else (1, 0)
        resumed = set()
        for event in step.events:
            blocks = self._reloads.pop(event.req_id, None)
            if blocks is not None and event.kind is PrefixCacheEventKind.EXTENDED:
                n = -(-event.hit_end // bs)
                if n > len(blocks):
                    raise OmniPrefixCacheUnmatchError(
                        f"request {event.req_id!r}: after a failed KV load its hit [0, {event.hit_end}) is longer "
                        f"than the prefix it was withheld with ({len(blocks)} blocks)")
                event = dataclasses.replace(event, kind=PrefixCacheEventKind.RESUMED,
                                            block_ids=((),) * group + (blocks[:n],))
                resumed.add(event.req_id)
            events.append(event)
        self.reloaded_req_ids = frozenset(resumed)
        return dataclasses.replace(step, events=tuple(events))

    def materialize(self, step_id: StepId) -> StageCacheOutputs:
        """Merged outputs of the save-time requests; a failed materialize
        discards the step (so its staging slot is not held) and re-raises."""
        with self._lock:
            req_ids = self._save_req_ids.pop(step_id, ())
        manager = self._require_manager()
        try:
            return manager.materialize(step_id, req_ids)
        except BaseException:
            # Already consumed, never saved, or a sticky failure: keep the first error.
            with contextlib.suppress(OmniPrefixCacheUnmatchError):
                manager.discard_step(step_id)
            raise

    def discard(self, step_id: StepId) -> None:
        """Consume the step without reading it (payload from live outputs, or error)."""
        with self._lock:
            self._save_req_ids.pop(step_id, None)
        self._require_manager().discard_step(step_id)

    def build_payload(
        self,
        step_id: StepId | None,
        build: Callable[[StageCacheOutputs | None], T],
        *,
        from_live_outputs: bool = False,
    ) -> T:
        """Consume ``step_id`` exactly once and build the stage payload.

        ``from_live_outputs``: the payload does not need the cache (discard).
        A step id of ``None`` (not fed) builds from live outputs.
        """
        if step_id is None:
            return build(None)
        if from_live_outputs:
            self.discard(step_id)
            return build(None)
        return build(self.materialize(step_id))

    def shutdown(self) -> dict[StepId, str]:
        """Shut the manager down; returns its unconsumed step ids (empty when none)."""
        if self._manager is None:
            return {}
        return dict(self._manager.shutdown())

    def _require_manager(self) -> Any:
        if self._manager is None:
            raise OmniPrefixCacheUnmatchError(
                "PrefixCacheRunnerHooks: no manager (no real step was fed on this rank); a step id "
                "here was never saved"
            )
        return self._manager
