"""The worker-process half of a multi-process ``simulate --engine vllm`` run.

Owns: ``exactly_once`` (check (c), ``consumer.exactly_once``, on a worker's final report, shared
by ``simulate`` and ``pipeline``) and ``WorkerProbe`` -- installed on each worker's runner bridge through
``LLM.collective_rpc`` (``install``), it does in the worker what the
in-process run does in its own process: the observer copies every real
forward of the output rank (``ForwardRecord``, tensors cloned, the scheduler
output reduced to the fields check (a) reads) and a consumer thread (the
talker, ``consumer.StepConsumer``) materializes every published step id. ``drain`` hands both to the
driver, which runs checks (a), (b) and (c) on them exactly as on an
in-process engine; ``finish`` ends the consumer and reports check (c)'s
exactly-once facts and the rank's host bytes.

The channel: ``LLM.collective_rpc(fn)`` with a module-level function of this
module, which vLLM sends by reference (cloudpickle) and runs as ``fn(worker)``
on every worker; with the engine core in the driver process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) replies come back over the executor's
shared-memory queues as pickles, so tensors cross unchanged and no
``VLLM_ALLOW_INSECURE_SERIALIZATION`` is needed. Every row a worker's
consumer was served reaches the driver and is checked; nothing is sampled.
Upholds nothing itself: I1 and I4 are checked from outside.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

from omni_cache.harness.vllm_engine.consumer import ExactlyOnce, StepConsumer, second_materialize_refused
from omni_cache.harness.vllm_engine.consumer import exactly_once as exactly_once_of
from omni_cache.harness.vllm_engine.truth import derive_mm
from omni_cache.integration.vllm_bridge import ForwardRecord

__all__ = ["ExactlyOnce", "WorkerProbe", "drain", "exactly_once", "finish", "install", "settle", "stats"]

ATTR = "omni_sim_probe"  # the probe's attribute on the worker's runner bridge


def _slim_scheduler_output(so: Any) -> SimpleNamespace:
    """What ``ForwardCapture.observe`` reads of a ``SchedulerOutput``, as plain values."""
    cached = getattr(so, "scheduled_cached_reqs", None)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.req_id, num_computed_tokens=int(r.num_computed_tokens))
                            for r in getattr(so, "scheduled_new_reqs", None) or ()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(getattr(cached, "req_ids", ()) or ()),
            num_computed_tokens=[int(n) for n in getattr(cached, "num_computed_tokens", ()) or ()],
            resumed_req_ids=set(getattr(cached, "resumed_req_ids", None) or ()),
        ),
    )


class WorkerProbe:
    """One worker's observer and consumer (see the module docstring)."""

    def __init__(self, bridge: Any, *, keep_records: bool) -> None:
        self.bridge = bridge
        self.keep_records = keep_records
        self._lock = threading.Lock()  # guards the three lists below (engine and consumer threads)
        self._records: list[ForwardRecord] = []
        self._served: list[tuple[int, int, tuple[tuple[str, int, int], ...], Any]] = []
        self._errors: list[tuple[int, int, str]] = []
        self.published: list[int] = []  # step ids of the records, in order (engine thread)
        self._stop = threading.Event()
        bridge.mm_outputs_fn = derive_mm
        bridge.observer = self.observe
        self.consumer = StepConsumer(bridge, served=self._serve, failed=self._fail)
        self._consumer = threading.Thread(target=self.consumer.run, args=(self._stop,), name="omni-probe-consumer",
                                          daemon=True)
        self._consumer.start()

    @property
    def consumed(self) -> Counter[int]:
        """Step id -> times the consumer thread took it."""
        return self.consumer.consumed

    # engine thread
    def observe(self, rec: ForwardRecord) -> None:
        if rec.step_id is not None:
            self.published.append(rec.step_id)
        if not self.keep_records:
            return
        copy = ForwardRecord(
            engine_step=rec.engine_step, step_id=rec.step_id, req_ids=tuple(rec.req_ids), spans=tuple(rec.spans),
            hidden_states=rec.hidden_states.detach().clone(), input_ids=rec.input_ids.clone(),
            positions=rec.positions.clone(), slot_mapping=rec.slot_mapping.clone(),
            mm_outputs={k: v.detach().clone() for k, v in rec.mm_outputs.items()},
            block_ids=dict(rec.block_ids), scheduler_output=_slim_scheduler_output(rec.scheduler_output))
        with self._lock:
            self._records.append(copy)

    # consumer thread
    def _serve(self, ps: Any, out: Any) -> None:
        with self._lock:
            self._served.append((ps.engine_step, ps.step_id, ps.spans, out))

    def _fail(self, ps: Any, exc: Exception) -> None:  # a contract error is a finding, reported with the step
        with self._lock:
            self._errors.append((ps.engine_step, ps.step_id, f"{type(exc).__name__}: {exc}"))

    def drain(self) -> dict[str, Any]:
        """Everything since the last drain. Served outputs are taken before
        records: a step's record is appended before its id is published, so
        every served step's record is in this drain or an earlier one."""
        with self._lock:
            served, self._served = self._served, []
            errors, self._errors = self._errors, []
        with self._lock:
            records, self._records = self._records, []
        return {"served": served, "errors": errors, "records": records}

    def finish(self) -> dict[str, Any]:
        """Wait until every published step id was consumed, stop the consumer,
        try a second materialize of a consumed id and shut the cache down."""
        self.bridge.step_ids.join()
        self._stop.set()
        self._consumer.join(timeout=60)
        manager = self.bridge.hooks.manager
        refused = manager is not None and bool(self.published) and second_materialize_refused(
            manager, self.published[0])
        rank = self.bridge.hooks.rank_stats()  # before shutdown: the bytes the run held
        unconsumed = {int(k): str(v) for k, v in self.bridge.shutdown().items()}
        return {**self.drain(), "published": list(self.published), "consumed": dict(self.consumed),
                "double_consume_refused": refused, "unconsumed": unconsumed, "rank": rank,
                "engine_steps": int(self.bridge.engine_step), "preemptions": int(self.bridge.preemptions),
                "zero_token_steps": int(self.bridge.zero_token_steps)}


def _bridge(worker: Any) -> Any:
    bridge = getattr(worker.model_runner, "omni_cache", None)
    if bridge is None:
        raise RuntimeError("this worker's model runner has no omni cache (worker_cls is not an omni worker)")
    return bridge


# Called on every worker as ``llm.collective_rpc(fn)``.
def install(worker: Any) -> dict[str, Any]:
    bridge = _bridge(worker)
    old = getattr(bridge, ATTR, None)
    if old is not None:
        raise RuntimeError("a probe is already installed on this worker")
    setattr(bridge, ATTR, WorkerProbe(bridge, keep_records=bridge.hooks.rank_stats().get("output_rank", True)))
    kv = worker.model_runner.kv_cache_config
    return {**bridge.hooks.rank_stats(), "num_blocks": int(kv.num_blocks), "kv_groups": len(kv.kv_cache_groups)}


def drain(worker: Any) -> dict[str, Any]:
    return getattr(_bridge(worker), ATTR).drain()


def settle(worker: Any) -> dict[str, Any]:
    """Wait until this worker's consumer took every published step id, then drain."""
    bridge = _bridge(worker)
    bridge.step_ids.join()
    return getattr(bridge, ATTR).drain()


def finish(worker: Any) -> dict[str, Any]:
    bridge = _bridge(worker)
    probe = getattr(bridge, ATTR)
    try:
        return probe.finish()
    finally:
        with contextlib.suppress(AttributeError):
            delattr(bridge, ATTR)


def stats(worker: Any) -> dict[str, Any]:
    return _bridge(worker).hooks.rank_stats()


def exactly_once(final: dict[str, Any]) -> ExactlyOnce:
    """Check (c) on a worker's ``finish`` reply (``consumer.exactly_once``)."""
    return exactly_once_of([int(s) for s in final["published"]],
                           Counter({int(k): int(v) for k, v in final["consumed"].items()}),
                           bool(final["double_consume_refused"]), dict(final["unconsumed"]))
