"""The logic behind the vLLM worker/model-runner subclasses (``vllm_worker``).

Owns: ``VllmRunnerBridge`` -- one engine stage's ``PrefixCacheRunnerHooks``,
the per-step state between ``execute_model`` and the forward (the scheduler
output, the engine step number), the queue of saved step ids handed to the
consumer (the next stage), and ``ForwardRecord``, what an observer sees of each
real forward (the engine's own positions, token ids and slot mapping, read
independently of the cache). The subclasses in ``vllm_worker`` only call into
this class, so everything here runs without vLLM on duck-typed objects.

Where the calls sit in vLLM's runner (the places vLLM-Omni's runner uses):
``on_model_loaded`` after ``load_model``; ``on_kv_cache_initialized`` (the
config gate, I5) at the top of ``initialize_kv_cache``, so a refused
configuration fails at engine start, before any step; ``begin_step`` at the top
of ``execute_model``, before vLLM drops finished requests (also for steps that
schedule zero tokens: their finished ids still reach the cache);
then, when the step's KV connector metadata carries an ``OmniKVConnector`` tier
plan (``omni_cache.integration.kv_tier``; found wherever vLLM nests it, ``kv_nesting``), the plan is
applied (stores, then loads) so restored rows are registered before the forward's save (a block
the tier could not restore is a failed KV load: the requests that read it are not served that
step, ``PrefixCacheRunnerHooks.withhold_failed_loads``);
``after_forward`` right after the model forward, with the forward's hidden
states and the runner's block table of the output KV-cache group
(``PrefixCacheConfig.output_group_id``; V1: ``runner.input_batch``; Model Runner
V2: ``runner.block_tables`` and its per-step ``InputBatch``). With speculative
decoding (V1), a step whose requests carry draft tokens is held after its save
until ``after_sample`` (the end of ``sample_tokens``) gives its verdict
(``spec_decode.verdict_of``, ``OmniPrefixCacheManager.trim_step``): only then is its
step id consumed or published, with the spans of the kept rows (I14).

Who consumes the step ids (``additional_config["omni_cache"]["consumer"]``): ``"deliver"``
(the default when the engine's ``OmniKVConnector`` delivers files: the worker consumes every
step id itself, right after its save, through ``delivery.RowDelivery``, so a served engine
needs no consumer outside its worker), ``"discard"`` (the default otherwise: every step id is
discarded at once and a warning at start says no rows leave the engine) or ``"queue"`` (code
in the worker's process consumes ``step_ids``: the in-process drivers of the harness). In the
first two modes a cache fault never takes the engine down: a failed materialize fails the
deliveries it was for, and a failed step (events, tier plan or save) fails the cache for good
-- it stops saving and serving, every delivery from then on fails with the reason -- while the
engine keeps serving; each such contained error is counted by kind (``errors``: the served
engine's ``vllm:omni_cache_errors``). In ``"queue"`` mode every error raises, as the contract says.

Upholds I1 on the producer side: every saved step id is consumed exactly once -- published
exactly once on ``step_ids`` (``"queue"``: the consumer must materialize or discard it exactly
once), or consumed by the delivery or discarded right after its save.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.integration.block_table import BlockTableView, V2BlockTableMirror
from omni_cache.integration.bridge_settings import CONFIG_KEY, BridgeSettings
from omni_cache.integration.kv_nesting import omni_metadata
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks
from omni_cache.integration.spec_decode import VerdictError, VerifySteps
from omni_cache.integration.vllm_logging import use_vllm_logging
from omni_cache.runtime.errors import ErrorTally, OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import ModelCachePolicy, ReqId, StepId

__all__ = ["ForwardRecord", "PublishedStep", "V2BlockTableMirror", "VllmRunnerBridge", "bridge_of",
           "runner_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishedStep:
    """What the consumer receives for one saved step."""

    step_id: StepId
    engine_step: int
    req_ids: tuple[ReqId, ...]
    spans: tuple[tuple[ReqId, int, int], ...]


@dataclass(frozen=True)
class ForwardRecord:
    """One real forward as the engine ran it (tensors are the engine's own
    buffers: an observer that keeps them must copy)."""

    engine_step: int
    step_id: StepId | None
    req_ids: tuple[ReqId, ...]
    spans: tuple[tuple[ReqId, int, int], ...]
    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    mm_outputs: dict[str, Any]
    block_ids: dict[ReqId, tuple[int, ...]] = field(default_factory=dict)
    scheduler_output: Any = field(repr=False, default=None)
    # requests served from position 0 again although vLLM did not resume them (after a failed KV load)
    resumed: frozenset[ReqId] = frozenset()


def runner_of(llm: Any) -> Any:
    """The model runner of an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker.model_runner


def bridge_of(llm: Any) -> VllmRunnerBridge:
    """The cache of an in-process ``vllm.LLM`` built with an omni ``worker_cls``."""
    bridge = getattr(runner_of(llm), "omni_cache", None)
    if not isinstance(bridge, VllmRunnerBridge):
        raise ValueError("bridge_of: this engine's runner has no omni cache; build it with worker_cls="
                         "'omni_cache.integration.vllm_worker.OmniCPUWorker' (or OmniGPUWorker)")
    return bridge


class _PolicyCarrier:
    """The legacy per-model attributes ``ModelCachePolicy.from_model`` reads."""

    def __init__(self, policy: ModelCachePolicy) -> None:
        self.requires_full_prefix_cached_hidden_states = policy.needs_full_hidden_states
        self.deferred_prefix_cache_mm_keys = tuple(sorted(policy.deferred_keys))
        self.mm_outputs_written_in_sample = policy.mm_outputs_written_in_sample


class VllmRunnerBridge:
    """The omni prefix cache of one vLLM engine stage (see the module docstring).

    ``settings``: ``additional_config["omni_cache"]``, parsed by ``BridgeSettings.parse``
    (``bridge_settings``); ``consumer`` says who consumes the step ids (the module docstring).
    ``mm_outputs_fn(hidden_states, record_spans) -> dict`` stands in for a
    model's per-token mm outputs; ``observer(ForwardRecord)`` sees every real
    forward. Both may be set after the engine is built, before its first step.
    """

    def __init__(self, settings: dict[str, Any] | None = None, *, hooks: PrefixCacheRunnerHooks | None = None) -> None:
        parsed = BridgeSettings.parse(settings)  # a malformed setting is refused here, naming its key
        self._consumer_setting: str | None = parsed.consumer
        # Decided at KV-cache initialisation (the engine's KV connector exists by then).
        self.consumer: str | None = parsed.consumer
        self.delivery: Any = None  # the worker's delivery.RowDelivery ("deliver")
        self.failed: str | None = None  # the cache failed for good ("deliver"/"discard" only)
        self.errors = ErrorTally()  # the contract errors contained here ("deliver"/"discard"), by kind
        self._policy_override: ModelCachePolicy | None = parsed.policy_override
        self.hooks = hooks if hooks is not None else PrefixCacheRunnerHooks(**parsed.hooks_kwargs)
        self.mm_outputs_fn: Callable[[torch.Tensor], dict[str, Any]] | None = None
        self.observer: Callable[[ForwardRecord], None] | None = None
        self.step_ids: queue.Queue[PublishedStep] = queue.Queue()
        self.engine_step = 0
        self.preemptions = 0
        self.zero_token_steps = 0  # steps that scheduled no token here (e.g. a non-last PP rank's)
        self._scheduler_output: Any = None
        self.v2_mirror: V2BlockTableMirror | None = None
        # The hidden-state tier of this worker's OmniKVConnector (found on first use; tests may set it).
        self.tier_applier: Any = None
        # This step's blocks whose rows the tier could not restore (vLLM's load errors): a request whose
        # cached prefix holds one is not served this step (vLLM recomputes or fails it).
        self._unrestorable: set[int] = set()
        # Sees every step's scheduler output at the top of begin_step (the simulation's tier truth).
        self.step_observer: Callable[[Any], None] | None = None
        # Speculative decoding (set at KV-cache initialisation): a verify step waits for its verdict.
        self.speculative = False
        self.verify_steps = VerifySteps()

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> VllmRunnerBridge:
        use_vllm_logging()
        extra = getattr(vllm_config, "additional_config", None) or {}
        return cls(extra.get(CONFIG_KEY) if isinstance(extra, dict) else None)

    # ------------------------------------------------------------- set-up
    def on_model_loaded(self, model: Any) -> ModelCachePolicy:
        carrier = model if self._policy_override is None else _PolicyCarrier(self._policy_override)
        return self.hooks.on_model_loaded(carrier)

    def on_kv_cache_initialized(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """The config gate on the engine's real configs, and who consumes the step ids; raises
        before any step."""
        self.hooks.on_kv_cache_initialized(vllm_config, kv_cache_config)
        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        self.resolve_consumer(_engine_delivery())
        from omni_cache.integration.metrics import bind_worker_metrics

        bind_worker_metrics(self)

    def resolve_consumer(self, delivery: Any) -> str:
        """Fix the consumer (see the module docstring) given the engine's ``RowDelivery`` (or ``None``)."""
        consumer = self._consumer_setting
        if consumer is None:
            consumer = "deliver" if delivery is not None else "discard"
            if consumer == "discard" and self.hooks.config is not None:
                log.warning("omni-cache: no OmniKVConnector with omni_cache.delivery_dir is configured, so no "
                            "hidden-state rows leave this engine; every step id is discarded (set "
                            "additional_config['%s']['consumer'] to 'discard' to say so, or configure delivery: "
                            "docs/serving.md)", CONFIG_KEY)
        if delivery is not None and self.hooks.config is None:
            raise OmniPrefixCacheUnmatchError(
                "omni prefix cache cannot run on this stage: kv_connector_extra_config['omni_cache']['delivery_dir'] "
                "asks for hidden-state files, but the cache is off here (prefix caching is disabled or the model "
                "is a pooling model); enable prefix caching or drop delivery_dir")
        if consumer == "deliver" and delivery is None:
            raise OmniPrefixCacheUnmatchError(
                f"omni prefix cache cannot run on this stage: additional_config['{CONFIG_KEY}']['consumer']='deliver' "
                "needs kv_transfer_config with kv_connector='OmniKVConnector' and "
                "kv_connector_extra_config={'omni_cache': {'delivery_dir': ...}} (docs/serving.md)")
        if delivery is not None and consumer != "deliver":  # the scheduler side would promise files never written
            raise OmniPrefixCacheUnmatchError(
                f"omni prefix cache cannot run on this stage: additional_config['{CONFIG_KEY}']['consumer']="
                f"'{consumer}' takes every step id away from the delivery, so no file would be written while "
                "kv_connector_extra_config['omni_cache']['delivery_dir'] promises clients hidden-state files (drop one)")
        policy = self.hooks.policy
        if consumer == "deliver" and policy is not None and policy.hidden_key is None:
            raise OmniPrefixCacheUnmatchError(
                f"omni prefix cache cannot run on this stage: the cache policy caches no hidden states "
                f"(additional_config['{CONFIG_KEY}']['needs_full_hidden_states']=false, or the model's), and a file "
                "kv_connector_extra_config['omni_cache']['delivery_dir'] delivers holds hidden_states (drop one)")
        if consumer == "deliver" and self.hooks.all_tp_ranks:
            raise OmniPrefixCacheUnmatchError(
                f"omni prefix cache cannot run on this stage: additional_config['{CONFIG_KEY}']['all_tp_ranks'] keeps "
                "a cache on every TP rank, and each would write the same delivery files; "
                "kv_connector_extra_config['omni_cache']['delivery_dir'] needs the output rank's cache alone (drop one)")
        self.consumer = consumer
        self.delivery = delivery if consumer == "deliver" else None
        return consumer

    @property
    def contained(self) -> bool:
        """Whether a cache fault stays inside the cache (``deliver``/``discard``) instead of raising."""
        return self.consumer in ("deliver", "discard")

    def fail(self, reason: str) -> None:
        """The cache failed for good: stop feeding it; every delivery fails with ``reason``."""
        if self.failed is None:
            log.error("omni-cache: %s; the cache stops here, the engine keeps serving, and every delivery "
                      "of hidden states fails from now on", reason)
            self.failed = reason
        if self.delivery is not None:
            self.delivery.fail_all(self.failed)

    @property
    def active(self) -> bool:
        return self.hooks.manager is not None

    # ------------------------------------------------------------- per step
    def begin_step(self, scheduler_output: Any) -> None:
        """Top of ``execute_model``: every real step, zero scheduled tokens included."""
        self.engine_step += 1
        if (unverified := self.verify_steps.take()) is not None:  # its sample_tokens never came
            self._drop(VerdictError(unverified, "sample_tokens did not run after its forward; its rows are discarded"))
        self.preemptions += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self.zero_token_steps += int(not getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        self._scheduler_output = scheduler_output
        self._unrestorable = set()
        # the OmniKVConnector metadata wherever vLLM nests it (MultiConnector: MultiKVConnectorMetadata.metadata)
        metadata = omni_metadata(getattr(scheduler_output, "kv_connector_metadata", None))
        if self.failed is None:
            plan = getattr(metadata, "omni_tier", None)
            try:
                self.hooks.begin_step(scheduler_output)  # builds the cache on the rank that holds it
                if self.step_observer is not None:
                    self.step_observer(scheduler_output)
                if plan and self.active:
                    self._apply_tier(plan)
            except Exception as exc:  # a contract error, or a step the adapter cannot read: the cache fails
                if not self.contained:
                    raise
                self.errors.record(exc)
                self._scheduler_output = None
                why = str(exc) if isinstance(exc, OmniPrefixCacheUnmatchError) else f"{type(exc).__name__}: {exc}"
                self.fail(f"engine step {self.engine_step}: {why}")
        if self.delivery is not None and (self.active or self.failed is not None):
            # only the rank that holds the cache delivers (it alone holds the files' locks)
            prompts = {r.req_id: r.prompt_token_ids for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ()}
            try:
                self.delivery.begin_step(getattr(metadata, "omni_delivery", None), prompts)
            except Exception as exc:  # e.g. a disk fault: the cache fails, the engine does not
                self._contain(exc, "the delivery's step start")

    def _apply_tier(self, plan: Any) -> None:
        """The ``OmniKVConnector`` tier plan of this step (stores, then loads), before the forward;
        the blocks it could not restore are this step's ``_unrestorable`` (the connector reports them
        to vLLM as failed loads)."""
        if self.tier_applier is None:
            from omni_cache.integration.kv_tier import worker_tier_applier

            self.tier_applier = worker_tier_applier()
        if self.tier_applier is None:
            raise OmniPrefixCacheUnmatchError(
                f"engine step {self.engine_step}: the KV connector metadata carries an omni-cache tier plan "
                "but this worker has no OmniKVConnector; the hidden rows of its external KV cannot be restored")
        self._unrestorable = set(self.tier_applier.apply(plan, self.hooks.manager))

    def after_forward_v1(
        self, runner: Any, hidden_states: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> StepId | None:
        """After the forward of V1's runner: the view is ``runner.input_batch``."""
        so = self._take_scheduler_output()
        if so is None:
            return None
        input_batch = runner.input_batch
        group = self._output_group()
        try:
            view = self.view_v1(input_batch)
        except Exception as exc:  # the engine's batch does not address the rows: nothing saved
            self._contain(exc, "its block-table view")
            return None
        # The engine's own slot mapping, for the observer: the buffer vLLM's slot-mapping kernel
        # writes (``.gpu``; its ``.cpu`` half is never filled, and the CPU runner aliases the two
        # only for the input batch it builds first, not for one rebuilt for several KV-cache groups).
        slot_mapping = input_batch.block_table.block_tables[group].slot_mapping.gpu
        return self._save(so, view, hidden_states, input_ids, positions, slot_mapping)

    def view_v1(self, input_batch: Any) -> BlockTableView:
        """The block-table view of V1's persistent batch, the output KV-cache group."""
        return BlockTableView.from_input_batch(input_batch, block_size=self._block_size(),
                                               kv_cache_group_id=self._output_group())

    def install_v2_block_mirror(self, block_tables: Any) -> V2BlockTableMirror:
        """Model Runner V2, after ``initialize_kv_cache``: mirror its device-only
        block table on the CPU (the output group) so views never read the device."""
        if self.speculative and self.active:
            raise OmniPrefixCacheUnmatchError(
                "omni prefix cache cannot run on this stage: speculative decoding with Model Runner V2 is not "
                "supported (the verdict of a verify step is read from V1's sample_tokens); set "
                "VLLM_USE_V2_MODEL_RUNNER=0 or disable speculative decoding")
        self.v2_mirror = V2BlockTableMirror.install(block_tables, self._output_group())
        return self.v2_mirror

    def after_forward_v2(self, runner: Any, input_batch: Any, hidden_states: torch.Tensor) -> StepId | None:
        """After the forward of Model Runner V2 (``execute_model_state``): the
        view is the step's ``InputBatch`` over the CPU mirror of
        ``runner.block_tables``."""
        so = self._take_scheduler_output()
        if so is None:
            return None
        mirror = self.v2_mirror
        if mirror is None or mirror.block_tables is not runner.block_tables:
            raise RuntimeError(
                "VllmRunnerBridge.after_forward_v2: runner.block_tables has no CPU mirror; call "
                "install_v2_block_mirror(runner.block_tables) after initialize_kv_cache"
            )
        try:
            view = mirror.view(input_batch, block_size=self._block_size())
            slots = view.slots_for_spans(
                [(rid, int(c), int(c) + int(n)) for rid, c, n in
                 zip(view.req_ids, view.num_computed_tokens, input_batch.num_scheduled_tokens, strict=False) if n]
            )
        except Exception as exc:  # the batch does not address the rows (or the mirror drifted)
            self._contain(exc, "its block-table view")
            return None
        return self._save(so, view, hidden_states, input_batch.input_ids, input_batch.positions, slots)

    # ------------------------------------------------------------- internals
    def _take_scheduler_output(self) -> Any:
        so, self._scheduler_output = self._scheduler_output, None
        if so is None or not self.active or self.failed is not None:
            return None
        return so

    def _block_size(self) -> int:
        config = self.hooks.config
        assert config is not None, "bridge active without a config: the gate must have run"
        return config.block_size

    def _output_group(self) -> int:
        """The KV-cache group whose block table addresses the rows (``output_group_id``)."""
        config = self.hooks.config
        return 0 if config is None else config.output_group_id

    def _save(
        self, so: Any, view: BlockTableView, hidden_states: torch.Tensor, input_ids: Any, positions: Any, slot_mapping: Any
    ) -> StepId | None:
        num_unpadded = int(so.total_num_scheduled_tokens)
        num_padded = int(hidden_states.shape[0])
        counts = {rid: int(n) for rid, n in so.num_scheduled_tokens.items()}
        spans = tuple(
            (rid, start, start + counts[rid])
            for rid, start in zip(view.req_ids, view.num_computed_tokens, strict=True)
            if counts.get(rid, 0) > 0
        )
        mm = self.mm_outputs_fn(hidden_states) if self.mm_outputs_fn is not None else {}
        try:
            step_id = self.hooks.after_forward(
                hidden_states, mm, view=view, num_tokens_unpadded=num_unpadded, num_tokens_padded=num_padded
            )
        except Exception as exc:  # a contract error, the step's write layout, or any other fault: contained
            self._contain(exc, "save_outputs")
            return None
        if self.observer is not None:
            self.observe_forward(so, view, spans, step_id, mm, hidden_states[:num_unpadded],
                                 input_ids[:num_unpadded], positions[:num_unpadded], slot_mapping[:num_unpadded])
        if self._unrestorable and step_id is not None:  # a failed KV load's requests: not served this step
            try:
                withheld = self.hooks.withhold_failed_loads(step_id, view, spans, self._unrestorable, self.engine_step)
            except Exception as exc:
                with contextlib.suppress(Exception):  # never left unconsumed (I1, I2); the first fault stands
                    self.hooks.discard(step_id)
                self._contain(exc, "withholding the rows of failed KV loads")
                return None
            spans = tuple(span for span in spans if span[0] not in withheld)
        if step_id is not None:
            held = self.speculative and self.verify_steps.hold(step_id, self.engine_step, spans, so)
            if not held:  # a step with draft rows awaits sampling's verdict (after_sample)
                self._consume(PublishedStep(step_id, self.engine_step, tuple(r for r, _, _ in spans), spans))
        return step_id

    def _contain(self, exc: Exception, what: str) -> None:
        """A step whose rows cannot be saved: with a worker-side consumer the cache fails for good
        (every open and later delivery fails with the reason; the engine keeps serving, and no later
        hit can read slots whose newest rows were never saved); with ``"queue"`` it raises."""
        if not self.contained:
            raise exc
        self.errors.record(exc)
        why = str(exc) if isinstance(exc, OmniPrefixCacheUnmatchError) else f"{type(exc).__name__}: {exc}"
        self.fail(f"engine step {self.engine_step}: {what} failed: {why}")

    @property
    def awaits_verdict(self) -> bool:
        """A verify step is held since its save, waiting for ``after_sample``."""
        return self.verify_steps.pending is not None

    def after_sample(self, output: Any, runner: Any) -> None:
        """End of V1's ``sample_tokens``: the verdict of the step held since its save, if any (the
        manager cuts the rows that are not the requests'), then the step id is consumed or
        published with the kept rows' spans (I14)."""
        try:
            settled = self.verify_steps.settle(output, runner, self.hooks.manager)
        except VerdictError as exc:
            self._drop(exc)
            return
        if settled is not None:
            step, spans = settled
            self._consume(PublishedStep(step.step_id, step.engine_step, tuple(r for r, _, _ in spans), spans))

    def _drop(self, exc: VerdictError) -> None:
        """A verify step without a verdict: its step id is discarded, never handed on, and the cache
        fails for good (``queue``: the error raises)."""
        with contextlib.suppress(OmniPrefixCacheUnmatchError):  # a failed manager refuses: the reason stands
            self.hooks.discard(exc.step.step_id)  # its save-time request ids go too
        if not self.contained:
            raise exc
        self.errors.record(exc)
        self.fail(str(exc))

    def _consume(self, published: PublishedStep) -> None:
        """Hand a saved step id to its one consumer (see the module docstring)."""
        if self.consumer == "queue":
            self.step_ids.put(published)
            return
        self.hooks.take_save_time_req_ids(published.step_id)  # consumed below, on the manager itself
        try:
            if self.delivery is not None:
                self.delivery.consume(self.hooks.manager, published.step_id, published.spans)
            else:
                self.hooks.manager.discard_step(published.step_id)
        except Exception as exc:  # a fault of the cache fails the cache, never the engine
            self.errors.record(exc)
            why = str(exc) if isinstance(exc, OmniPrefixCacheUnmatchError) else f"{type(exc).__name__}: {exc}"
            self.fail(f"engine step {self.engine_step}: consuming step {published.step_id} failed: {why}")

    def observe_forward(self, so: Any, view: BlockTableView, spans: tuple[tuple[ReqId, int, int], ...],
                        step_id: StepId | None, mm: dict[str, Any], hidden_states: torch.Tensor, input_ids: Any,
                        positions: Any, slot_mapping: Any) -> None:
        """Hand ``observer`` the step's ``ForwardRecord`` (only when one is set: a checker's cost,
        never the cache's; a harness times this call as the checker's)."""
        assert self.observer is not None, "observe_forward without an observer"
        self.observer(
            ForwardRecord(
                engine_step=self.engine_step,
                step_id=step_id,
                req_ids=view.req_ids,
                spans=spans,
                hidden_states=hidden_states,
                input_ids=torch.as_tensor(input_ids),
                positions=torch.as_tensor(positions),
                slot_mapping=torch.as_tensor(slot_mapping),
                mm_outputs=mm,
                block_ids={rid: view.blocks_of(rid) for rid, _, _ in spans},
                scheduler_output=so,
                resumed=self.hooks.reloaded_req_ids,
            )
        )

    def shutdown(self) -> dict[StepId, str]:
        """Shut the cache down; its unconsumed step ids (none unless a ``queue`` consumer left some)."""
        unconsumed = self.hooks.shutdown()
        log.info("omni-cache: worker cache shut down after %d engine steps (consumer %s): %d unconsumed step ids",
                 self.engine_step, self.consumer, len(unconsumed))
        return unconsumed


def _engine_delivery() -> Any:
    """The ``RowDelivery`` of this worker's ``OmniKVConnector``, or ``None`` (no vLLM, no connector,
    or a connector without delivery)."""
    try:
        from omni_cache.integration.kv_tier import worker_delivery

        return worker_delivery()
    except ImportError:
        return None
