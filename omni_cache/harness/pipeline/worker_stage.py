"""The worker-process half of a parallel thinker in ``omni-cache pipeline --tp N --pp M``.

Owns the functions the driver runs on every worker as ``LLM.collective_rpc(fn)``
(module-level, so vLLM sends them by reference; replies are plain values and
tensors, which cross the executor's queues unchanged):

* ``attach`` (the thinker with prefix caching, the project's worker): a fresh
  cache on the worker's runner (the old one shut down; on a rank that holds no
  cache it allocates nothing), ``vllm_sim.worker_probe``'s probe on it (the
  output rank's forward records; a consumer thread that materializes every
  published step id, as the in-process stage does right after each step) and
  the stage timers of ``pipeline.stages`` (forward, save, materialize);
* ``install_tap`` / ``drain_tap`` / ``remove_tap`` (the thinker with prefix
  caching off, vLLM's own worker): ``stages.ForwardTap`` on the output rank
  reads each request's prompt rows straight from the forward -- the ground
  truth never goes through the cache. ``install_tap`` also allocates the
  intermediate-tensors buffer a non-first pipeline stage needs in eager mode
  (``integration.vllm_worker.allocate_intermediate_tensors``: vLLM's skipped
  warm-up would have);
* ``detach`` (after ``worker_probe.finish``): the runner's own forward back, the
  timers returned; ``timers``: the stage timers so far, as a dict.

Upholds nothing itself: the driver checks I1, I4, I6 and I7 on what comes back.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from omni_cache.harness.pipeline.stages import ForwardTap, StageTimers, install_stage_timers
from omni_cache.harness.vllm_engine import worker_probe
from omni_cache.integration.ranks import vllm_worker_rank

__all__ = ["attach", "detach", "drain_tap", "install_tap", "remove_tap", "timers"]

TIMERS = "omni_pipeline_timers"  # the stage timers, an attribute of the worker's model runner
TAP = "omni_pipeline_tap"  # the ForwardTap of the truth thinker, on the output rank's runner


class _PromptLengths:
    """``ForwardTap``'s request -> prompt length, read from the runner's own request states
    (the driver's engine-side ids are the runner's)."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def get(self, rid: str, default: int = 0) -> int:
        state = self._runner.requests.get(rid)
        return default if state is None else int(state.num_prompt_tokens)


def attach(worker: Any) -> dict[str, Any]:
    """A fresh cache, the probe and the timers on this worker (the engine is idle: the driver has
    just reset its prefix cache)."""
    from omni_cache.integration.vllm_bridge import VllmRunnerBridge

    runner = worker.model_runner
    old = getattr(runner, "omni_cache", None)
    if old is None:
        raise RuntimeError("pipeline attach: this worker's model runner has no omni cache (not an omni worker)")
    if getattr(old, worker_probe.ATTR, None) is not None:
        raise RuntimeError("pipeline attach: the previous stage's probe was never finished")
    if old.active:
        old.shutdown()
    bridge = VllmRunnerBridge.from_vllm_config(runner.vllm_config)
    bridge.on_model_loaded(runner.get_model())
    bridge.on_kv_cache_initialized(runner.vllm_config, runner.kv_cache_config)
    runner.omni_cache = bridge
    info = worker_probe.install(worker)
    t = StageTimers()
    setattr(runner, TIMERS, t)
    probe = getattr(bridge, worker_probe.ATTR)

    def observe(rec: Any) -> None:
        t.steps += 1
        probe.observe(rec)

    install_stage_timers(runner, bridge, t, observe)
    real_materialize = bridge.hooks.materialize

    def materialize(*args: Any, **kwargs: Any) -> Any:  # the probe's consumer thread
        start = time.perf_counter()
        try:
            return real_materialize(*args, **kwargs)
        finally:
            t.materialize_s += time.perf_counter() - start

    setattr(bridge.hooks, "materialize", materialize)  # noqa: B010 (an instance attribute: this run's timer)
    return info


def detach(worker: Any) -> dict[str, Any]:
    """After ``worker_probe.finish`` (the cache is shut down): the runner's own ``_model_forward``
    back and the timers dropped, so the next ``attach`` wraps the runner's method, not this run's
    wrapper; returns this run's timers."""
    runner = worker.model_runner
    out = timers(worker)
    runner.__dict__.pop("_model_forward", None)
    runner.__dict__.pop(TIMERS, None)
    return out


def timers(worker: Any) -> dict[str, Any]:
    t = getattr(worker.model_runner, TIMERS, None)
    return asdict(t) if t is not None else {}


def install_tap(worker: Any) -> dict[str, Any]:
    """The truth thinker's tap on the output rank (nothing on the other ranks)."""
    from omni_cache.integration.vllm_worker import allocate_intermediate_tensors

    runner = worker.model_runner
    allocated = allocate_intermediate_tensors(runner)
    rank = vllm_worker_rank()
    if getattr(runner, TAP, None) is not None:
        raise RuntimeError("pipeline install_tap: a tap is already installed on this worker")
    if rank.is_output_rank:
        t = StageTimers()
        setattr(runner, TIMERS, t)
        setattr(runner, TAP, ForwardTap(runner, _PromptLengths(runner), t))
    return {**rank.as_dict(), "intermediate_tensors_allocated": allocated}


def drain_tap(worker: Any) -> dict[str, Any]:
    """The prompt rows read since the last drain, and the prompt positions computed so far."""
    tap = getattr(worker.model_runner, TAP, None)
    if tap is None:
        return {"rows": {}, "computed": 0}
    rows, tap.rows = tap.rows, {}
    return {"rows": rows, "computed": int(tap.computed)}


def remove_tap(worker: Any) -> dict[str, Any]:
    """The runner's own methods back; the last rows and the timers."""
    runner = worker.model_runner
    out = {**drain_tap(worker), "timers": timers(worker)}
    tap = getattr(runner, TAP, None)
    if tap is not None:
        tap.remove()
        delattr(runner, TAP)
    return out
