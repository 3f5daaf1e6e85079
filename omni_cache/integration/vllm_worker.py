"""vLLM worker and model-runner subclasses that run the omni prefix cache.

Owns: ``OmniCPUWorker`` (install it with ``LLM(..., worker_cls=
"omni_cache.integration.vllm_worker.OmniCPUWorker")``), ``OmniGPUWorker``
(same, on GPUs: V1 or Model Runner V2, whichever vLLM picks) and the runner
subclasses they build: ``OmniCPUModelRunner`` (vLLM's V1 ``CPUModelRunner``)
and, per runner base, a V1 or V2 subclass. The overrides only call
``VllmRunnerBridge`` (``omni_cache.integration.vllm_bridge``), where the logic
is. Classes are built on first attribute access (PEP 562 ``__getattr__``), so
importing this module never imports vLLM ("no vLLM import at module scope"
holds) and vLLM's own ``worker_cls`` lookup (``import_module`` + ``getattr``)
still finds them.

Upholds I5 (the config gate runs on the engine's real configs) and the
spec/protocol.md call order on the real runners: the gate at
KV-cache initialisation (before the KV cache is allocated, so a refused
configuration fails at engine start), ``begin_step`` before the runner drops
finished requests (also for steps with zero scheduled tokens), ``after_forward``
with the real hidden states and block table, and, with speculative decoding,
each verify step's verdict once ``sample_tokens`` has the sampled tokens on the
CPU (``_bookkeeping_sync``), before it finalizes the KV connector (I14); warmup
and dummy runs are never fed. The cache is built on the output rank only (``ranks``); ``omni_cache_stats``
is the worker method ``LLM.collective_rpc("omni_cache_stats")`` calls to read
each rank's place, host bytes and the numbers behind its metrics. With pipeline parallelism and
``enforce_eager=True`` the CPU runner skips its warm-up, the one place a
non-first pipeline rank allocates the buffer for the previous stage's
intermediate tensors; ``OmniCPUWorker`` allocates it as that warm-up would.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

_LAZY = ("OmniCPUModelRunner", "OmniCPUWorker", "OmniGPUWorker")  # built by __getattr__ on first access
__all__: list[str] = ["allocate_intermediate_tensors", "omni_runner_class", "shutdown_worker_cache",
                      "worker_cache_stats"]


@functools.cache
def omni_runner_class(base: type, v2: bool) -> type:
    """``base`` (a vLLM model-runner class) with the cache wired in; ``v2``: Model Runner V2."""
    from omni_cache.integration.spec_decode import bookkeeping_tokens
    from omni_cache.integration.vllm_bridge import VllmRunnerBridge

    class _OmniRunnerCommon(base):
        def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(vllm_config, device, *args, **kwargs)
            self.omni_cache = VllmRunnerBridge.from_vllm_config(vllm_config)

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            self.omni_cache.on_model_loaded(self.get_model())

    if not v2:

        class OmniModelRunnerV1(_OmniRunnerCommon):
            """V1 runner: ``begin_step`` first in ``execute_model``; the one forward of the step
            (``_model_forward``) is fed with ``self.input_batch`` as the view."""

            _omni_in_step = False

            def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
                self.omni_cache.on_kv_cache_initialized(self.vllm_config, kv_cache_config)
                super().initialize_kv_cache(kv_cache_config, *args, **kwargs)

            def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
                self.omni_cache.begin_step(scheduler_output)
                self._omni_in_step = True
                try:
                    return super().execute_model(scheduler_output, intermediate_tensors)
                finally:
                    self._omni_in_step = False

            def _model_forward(self, input_ids: Any = None, positions: Any = None, *args: Any, **kwargs: Any) -> Any:
                out = super()._model_forward(input_ids, positions, *args, **kwargs)
                if self._omni_in_step:
                    self._omni_in_step = False  # one forward per step is fed
                    # EAGLE-3 targets return (hidden states, auxiliary hidden states)
                    hidden = out[0] if isinstance(out, tuple) else out
                    self.omni_cache.after_forward_v1(self, hidden, input_ids, positions)
                return out

            def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
                out = super()._bookkeeping_sync(*args, **kwargs)
                # A verify step's verdict (speculative decoding): the sampled tokens are on the CPU now,
                # before sample_tokens finalizes the KV connector (the delivery's files of this step).
                if self.omni_cache.awaits_verdict:  # nothing to read on a step without drafts
                    self.omni_cache.after_sample(bookkeeping_tokens(out), self)
                return out

        OmniModelRunnerV1.__name__ = OmniModelRunnerV1.__qualname__ = f"Omni{base.__name__}"
        return OmniModelRunnerV1

    class OmniModelRunnerV2(_OmniRunnerCommon):
        """Model Runner V2: block ids live on the device, so a CPU mirror of
        ``self.block_tables`` is installed at KV-cache initialisation; the step's
        ``InputBatch`` and hidden states are read from ``execute_model_state``."""

        def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
            self.omni_cache.on_kv_cache_initialized(self.vllm_config, kv_cache_config)
            super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
            self.omni_cache.install_v2_block_mirror(self.block_tables)

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None, *args: Any,
                          dummy_run: bool = False, **kwargs: Any) -> Any:
            if dummy_run:
                return super().execute_model(scheduler_output, intermediate_tensors, *args, dummy_run=True, **kwargs)
            self.omni_cache.begin_step(scheduler_output)  # before finish_requests drops finished ids
            before = self.execute_model_state
            out = super().execute_model(scheduler_output, intermediate_tensors, *args, **kwargs)
            state = self.execute_model_state
            if state is not None and state is not before and state.hidden_states is not None:
                self.omni_cache.after_forward_v2(self, state.input_batch, state.hidden_states)
            return out

    OmniModelRunnerV2.__name__ = OmniModelRunnerV2.__qualname__ = f"Omni{base.__name__}V2"
    return OmniModelRunnerV2


def allocate_intermediate_tensors(runner: Any) -> bool:
    """On a non-first pipeline rank, allocate ``runner.intermediate_tensors`` (the
    buffer the previous stage's activations are received into) as vLLM's warm-up
    (``_dummy_run``) does, if nothing allocated it; True when it allocated."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


def worker_cache_stats(worker: Any) -> dict[str, Any]:
    """One worker's rank (global ``rank`` as vLLM numbers it), whether it holds
    the cache, its host bytes and its step counts, plus the numbers behind its
    metrics (``metrics.cache_sources``: the manager's full ``stats()``, the
    delivery's and the tier's counters, the contained errors by kind); plain
    values only, so the reply crosses any of vLLM's RPC channels (a served
    engine's ``/collective_rpc`` too)."""
    from omni_cache.integration.metrics import cache_sources, worker_metrics

    bridge = getattr(worker.model_runner, "omni_cache", None)
    if bridge is None:
        raise RuntimeError("omni_cache_stats: this worker's model runner has no omni cache")
    reporter = worker_metrics()
    sources = cache_sources(bridge, reporter.delivery, reporter.tier) if reporter is not None else cache_sources(bridge)
    return {**bridge.hooks.rank_stats(), "engine_steps": int(bridge.engine_step),
            "preemptions": int(bridge.preemptions),
            "zero_token_steps": int(bridge.zero_token_steps),
            "reports_metrics": reporter is not None and reporter.reporting, **sources}


def shutdown_worker_cache(worker: Any) -> None:
    """Shut the worker's cache down before vLLM shuts the worker (and its KV connector) down:
    saves in progress land, and the log says how many step ids were left unconsumed (none
    unless a ``queue`` consumer left some). Never raises: the worker's own shutdown follows."""
    bridge = getattr(getattr(worker, "model_runner", None), "omni_cache", None)
    if bridge is None or not bridge.active:
        return
    try:
        bridge.shutdown()
    except Exception:  # shutdown must go on; the error is in the log
        logging.getLogger(__name__).exception("omni-cache: the worker cache's shutdown failed")


@functools.cache
def _build_classes() -> dict[str, type]:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from omni_cache.integration.config_gate import refuse_unservable_config

    cpu_runner = omni_runner_class(CPUModelRunner, False)

    class OmniCPUWorker(CPUWorker):
        """vLLM's CPU worker whose model runner is ``OmniCPUModelRunner`` (V1)."""

        runs_omni_cache = True  # config_gate.omni_worker_problem: this class and its subclasses run the cache

        def init_device(self) -> None:
            refuse_unservable_config(self.vllm_config)  # before vLLM's own start can fail on it
            super().init_device()
            if getattr(self, "use_v2_model_runner", False):
                raise RuntimeError(
                    "OmniCPUWorker: vLLM chose Model Runner V2 on CPU; set VLLM_USE_V2_MODEL_RUNNER=0"
                )
            self.model_runner = cpu_runner(self.vllm_config, self.device)

        def compile_or_warm_up_model(self) -> Any:
            times = super().compile_or_warm_up_model()
            allocate_intermediate_tensors(self.model_runner)
            return times

        def omni_cache_stats(self) -> dict[str, Any]:
            return worker_cache_stats(self)

        def shutdown(self) -> None:
            shutdown_worker_cache(self)
            super().shutdown()

    class OmniGPUWorker(Worker):
        """vLLM's GPU worker whose runner (V1, or V2 where vLLM picks it) feeds the cache."""

        runs_omni_cache = True

        def init_device(self) -> None:
            refuse_unservable_config(self.vllm_config)  # before vLLM's own start can fail on it
            super().init_device()

        def _make_model_runner(self) -> Any:
            if self.use_v2_model_runner:
                if self.vllm_config.is_mm_encoder_only:
                    raise RuntimeError("OmniGPUWorker: an encoder-only stage has no per-token outputs to cache")
                from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2

                return omni_runner_class(RunnerV2, True)(self.vllm_config, self.device)
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1

            return omni_runner_class(RunnerV1, False)(self.vllm_config, self.device)

        def omni_cache_stats(self) -> dict[str, Any]:
            return worker_cache_stats(self)

        def shutdown(self) -> None:
            shutdown_worker_cache(self)
            super().shutdown()

    return {"OmniCPUModelRunner": cpu_runner, "OmniCPUWorker": OmniCPUWorker, "OmniGPUWorker": OmniGPUWorker}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _build_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
