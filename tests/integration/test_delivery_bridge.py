"""Who consumes the step ids in a served engine: the runner bridge's consumer modes, without vLLM.

Protected first, I1 on the producer side: in ``"deliver"`` and ``"discard"`` mode every saved step
id is consumed in the worker right after its save (nothing is left for a consumer that does not
exist in a served engine), in ``"queue"`` mode each is published exactly once and left to the
queue's consumer; the hooks keep no save-time request ids for steps already consumed (a server runs
for ever). Then containment: in ``"deliver"``/``"discard"`` mode a cache fault fails the cache for
good (``bridge.failed``) without raising into the engine, later steps never touch the manager
again, and every open and later delivery fails with the reason, while the engine keeps stepping;
in ``"queue"`` mode the same fault raises, as the contract says. Only the rank that holds the cache
delivers (it alone takes the files' locks). ``resolve_consumer`` refuses ``"deliver"`` without a
delivery and a delivery on a stage whose cache is off, and defaults to ``"deliver"`` or (warning)
``"discard"``. Driven by ``delivery_helpers.ServedLoop``: the integration fakes' scheduler and
runner around a real bridge, manager and ``RowDelivery``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from delivery_helpers import ServedLoop, expected_rows, read

from omni_cache import OmniPrefixCacheUnmatchError
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.interface import PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager

PREFIX = list(range(10, 18))


def _workload(loop: ServedLoop) -> None:
    loop.add("A", [*PREFIX, 1, 2], max_tokens=3)
    loop.run()
    loop.add("B", [*PREFIX, 3, 4, 5], max_tokens=2)
    loop.add("C", [*PREFIX, 6], max_tokens=4, include_output_tokens=True)
    loop.run()


class _Saves:
    """Records the step ids the bridge saved (an observer of every real forward)."""

    def __init__(self, loop: ServedLoop) -> None:
        self.ids: list[int] = []
        loop.bridge.observer = lambda record: self.ids.append(record.step_id)


# ------------------------------------------------------------------------- consumer modes
def test_deliver_consumes_every_step_in_the_worker_and_writes_the_files(tmp_path: Path) -> None:
    loop = ServedLoop(str(tmp_path))
    saves = _Saves(loop)
    _workload(loop)
    assert loop.bridge.consumer == "deliver" and loop.bridge.delivery is loop.delivery
    stats = loop.manager.stats()
    assert stats["unconsumed_step_ids"] == {} and stats["materialized"] + stats["discarded"] == len(saves.ids)
    assert stats["materialized"] > 0 and stats["discarded"] > 0 and loop.bridge.step_ids.empty()
    for req in "ABC":
        data = read(loop.path_of(req))
        n = data["token_ids"].shape[0]
        assert torch.equal(data["hidden_states"], expected_rows(loop.prompts[req], n))
    assert loop.outputs["B"]["hidden_states_cached_tokens"] == 8
    assert loop.close() == {}


def test_discard_consumes_every_step_at_once_and_writes_nothing(tmp_path: Path) -> None:
    loop = ServedLoop(str(tmp_path), consumer="discard", deliver=False)
    saves = _Saves(loop)
    _workload(loop)
    assert loop.bridge.consumer == "discard" and loop.bridge.delivery is None
    stats = loop.manager.stats()
    assert stats["unconsumed_step_ids"] == {} and stats["discarded"] == len(saves.ids) and stats["materialized"] == 0
    assert loop.bridge.step_ids.empty() and os.listdir(tmp_path) == []
    assert loop.close() == {}


def test_queue_publishes_each_step_once_for_its_consumer(tmp_path: Path) -> None:
    loop = ServedLoop(str(tmp_path), consumer="queue", deliver=False)
    saves = _Saves(loop)
    published = []
    loop.add("A", [*PREFIX, 1, 2], max_tokens=3)
    loop.add("B", [*PREFIX, 3, 4, 5], max_tokens=2)
    while loop.scheduler.requests or loop.scheduler.waiting:
        loop.step()
        left = set(loop.manager.stats()["unconsumed_step_ids"]) if loop.manager else set()
        assert left == set(saves.ids[len(published):]), "each saved step waits for the queue's consumer"
        while not loop.bridge.step_ids.empty():
            published.append(loop.bridge.step_ids.get_nowait())
            loop.bridge.hooks.materialize(published[-1].step_id)  # the consumer, once per step
    assert [p.step_id for p in published] == saves.ids and len(saves.ids) == 3
    assert all(p.spans and p.req_ids == tuple(r for r, _, _ in p.spans) for p in published)
    assert loop.manager.stats()["unconsumed_step_ids"] == {} and os.listdir(tmp_path) == []
    assert loop.close() == {}


@pytest.mark.parametrize("consumer", ["deliver", "discard"])
def test_the_hooks_keep_nothing_of_a_step_the_worker_consumed(tmp_path: Path, consumer: str) -> None:
    loop = ServedLoop(str(tmp_path), consumer=consumer, deliver=consumer == "deliver")
    saves = _Saves(loop)
    _workload(loop)
    assert saves.ids and [s for s in saves.ids if loop.bridge.hooks.save_time_req_ids(s) is not None] == []
    assert loop.close() == {}


# ---------------------------------------------------------------------------- containment
class _FailingSaves:
    """A manager factory whose managers' ``save_outputs`` raises on call ``fail_at`` (a cache
    fault), counting every call the bridge makes into the manager."""

    def __init__(self, fail_at: int, where: str = "save_outputs") -> None:
        self.fail_at, self.where = fail_at, where
        self.calls = {"new_step_starts": 0, "save_outputs": 0}

    def __call__(self, config: PrefixCacheConfig, **kwargs: Any) -> OmniPrefixCacheManager:
        spy = self

        class Failing(OmniPrefixCacheManager):
            def new_step_starts(self, *args: Any, **kw: Any) -> None:
                spy._count("new_step_starts")
                super().new_step_starts(*args, **kw)

            def save_outputs(self, *args: Any, **kw: Any) -> Any:
                spy._count("save_outputs")
                return super().save_outputs(*args, **kw)

        return Failing(config, **kwargs)

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if name == self.where and self.calls[name] == self.fail_at:
            raise OmniPrefixCacheUnmatchError(f"{name} refused: an injected cache fault")


@pytest.mark.parametrize("where", ["save_outputs", "new_step_starts"])
@pytest.mark.parametrize("consumer", ["deliver", "discard"])
def test_a_cache_fault_fails_the_cache_for_good_and_the_engine_keeps_serving(tmp_path: Path, consumer: str,
                                                                              where: str) -> None:
    faults = _FailingSaves(fail_at=3, where=where)
    hooks = PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True, manager_factory=faults)
    loop = ServedLoop(str(tmp_path), consumer=consumer, hooks=hooks, max_batched=4, deliver=consumer == "deliver")
    loop.add("A", [*PREFIX, 1, 2], max_tokens=2)  # prefill in 3 chunks of 4: the fault hits its last one
    loop.step()
    loop.step()
    assert loop.bridge.failed is None
    loop.step()  # no exception reaches the engine
    assert loop.bridge.failed is not None and "injected cache fault" in loop.bridge.failed
    calls = dict(faults.calls)
    loop.add("B", [*PREFIX, 3], max_tokens=2)
    loop.run()
    assert faults.calls == calls, "a failed cache is never fed again"
    assert set(loop.outputs) == {"A", "B"}  # both requests ran to the end
    if consumer == "deliver":
        for req in ("A", "B"):
            error = loop.outputs[req]["hidden_states_error"]
            assert "injected cache fault" in error and "hidden_states_path" not in loop.outputs[req]
        assert [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")] == []
    assert loop.manager.stats()["unconsumed_step_ids"] == {}
    loop.close()


def _second_call_raises(real: Any, error: Exception) -> Any:
    """``real``, except that its second call raises ``error`` (a fault in the engine's second step)."""
    calls = {"n": 0}

    def call(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        return real(*args)

    return call


@pytest.mark.parametrize("consumer", ["deliver", "discard", "queue"])
def test_a_step_whose_batch_does_not_address_its_rows_fails_the_cache_not_the_engine(
    tmp_path: Path, consumer: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's batch refused as a block-table view (here: an injected ``ValueError``, as a stale
    or malformed table raises) leaves the step's rows unsaved: with a worker-side consumer the cache
    fails for good naming the step and the error, and the engine keeps serving; with ``"queue"`` it raises."""
    loop = ServedLoop(str(tmp_path), consumer=consumer, max_batched=4, deliver=consumer == "deliver")
    monkeypatch.setattr(loop.bridge, "view_v1", _second_call_raises(
        loop.bridge.view_v1, ValueError("BlockTableView: an injected malformed block table")))
    loop.add("A", [*PREFIX, 1, 2], max_tokens=2)
    loop.step()
    if consumer == "queue":
        with pytest.raises(ValueError, match="injected malformed"):
            loop.step()
        loop.close()
        return
    loop.step()  # no exception reaches the engine
    failed = loop.bridge.failed
    assert failed is not None and "engine step 2: its block-table view failed: ValueError" in failed, failed
    loop.run()
    assert set(loop.outputs) == {"A"}
    if consumer == "deliver":
        assert "injected malformed" in loop.outputs["A"]["hidden_states_error"]
    assert loop.manager.stats()["unconsumed_step_ids"] == {}
    loop.close()


def test_a_delivery_fault_at_the_step_start_fails_the_cache_not_the_engine(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    loop = ServedLoop(str(tmp_path), max_batched=4)
    monkeypatch.setattr(loop.delivery, "begin_step", _second_call_raises(
        loop.delivery.begin_step, OSError(30, "Read-only file system")))
    loop.add("A", [*PREFIX, 1, 2], max_tokens=2)
    loop.step()
    loop.step()  # no exception reaches the engine
    assert loop.bridge.failed is not None and "the delivery's step start failed: OSError" in loop.bridge.failed
    loop.run()
    assert "Read-only file system" in loop.outputs["A"]["hidden_states_error"]
    assert loop.manager.stats()["unconsumed_step_ids"] == {}
    loop.close()


def test_a_step_the_adapter_cannot_read_fails_the_cache_not_the_engine(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the contract error: any error of the step's start (here a ValueError of the adapter,
    as a malformed scheduler output raises) fails the cache, named, and the engine keeps serving."""
    loop = ServedLoop(str(tmp_path), max_batched=4)
    adapter = loop.bridge.hooks.adapter
    monkeypatch.setattr(adapter, "translate_step", _second_call_raises(
        adapter.translate_step, ValueError("an injected scheduler output the adapter cannot read")))
    loop.add("A", [*PREFIX, 1, 2], max_tokens=2)
    loop.step()
    loop.step()  # no exception reaches the engine
    failed = loop.bridge.failed
    assert failed is not None and "engine step 2: ValueError: an injected scheduler output" in failed, failed
    loop.run()
    assert "an injected scheduler output" in loop.outputs["A"]["hidden_states_error"]
    loop.close()


@pytest.mark.parametrize("where", ["save_outputs", "new_step_starts"])
def test_in_queue_mode_a_cache_fault_raises(tmp_path: Path, where: str) -> None:
    hooks = PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True, manager_factory=_FailingSaves(1, where))
    loop = ServedLoop(str(tmp_path), consumer="queue", hooks=hooks, deliver=False)
    loop.add("A", PREFIX)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="injected cache fault"):
        loop.step()
    assert loop.bridge.failed is None
    loop.close()


class _RefusingDelivery:
    """A delivery whose consume raises what a manager refusing a consume raises."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def begin_step(self, plan: Any, prompts: Any) -> None:
        return None

    def consume(self, manager: Any, step_id: int, spans: Any) -> None:
        raise OmniPrefixCacheUnmatchError(f"step {step_id} is already consumed or never saved")

    def fail_all(self, reason: str) -> None:
        self.failed.append(reason)


def test_a_consume_the_manager_refuses_fails_the_cache_not_the_engine(tmp_path: Path) -> None:
    loop = ServedLoop(str(tmp_path))
    refusing = _RefusingDelivery()
    loop.bridge.resolve_consumer(refusing)
    loop.add("A", PREFIX)
    loop.step()
    assert "consuming step" in loop.bridge.failed and "already consumed" in loop.bridge.failed
    assert refusing.failed == [loop.bridge.failed]
    (left,) = loop.manager.stats()["unconsumed_step_ids"]  # the refusing consumer took nothing
    loop.bridge.hooks.discard(left)
    assert loop.close() == {}


def test_only_the_rank_that_holds_the_cache_delivers(tmp_path: Path) -> None:
    # as the connector builds it on a rank that is not the output rank: its store does not claim the directory
    other = ServedLoop(str(tmp_path / "other"), hooks=PrefixCacheRunnerHooks(is_last_pp_rank=False, eager=True),
                       claim=False)
    other.add("A", PREFIX, max_tokens=2)
    other.run()
    assert other.bridge.consumer == "deliver" and other.manager is None
    assert not (tmp_path / "other").exists(), "a rank without the cache takes no lock and writes no file"
    assert other.delivery.take_results() == ()
    other.close()
    output = ServedLoop(str(tmp_path / "output"))
    output.add("A", PREFIX, max_tokens=2)
    output.step()
    assert os.path.exists(output.settings.paths().default_path("A") + ".lock")
    output.run()
    assert os.path.exists(output.path_of("A"))
    output.close()


# --------------------------------------------------------------------------- resolve_consumer
def _configured(settings: dict[str, Any] | None = None, *, cache_on: bool = True) -> VllmRunnerBridge:
    every_rank = bool((settings or {}).get("all_tp_ranks"))  # as the bridge builds its own hooks from the setting
    bridge = VllmRunnerBridge(settings, hooks=PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True,
                                                                     all_tp_ranks=every_rank))
    bridge.hooks.configure(PrefixCacheConfig(num_blocks=8, block_size=4) if cache_on else None)
    return bridge


def test_deliver_without_a_delivery_is_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"consumer'\]='deliver' needs kv_transfer_config"):
        _configured({"consumer": "deliver"}).resolve_consumer(None)


def test_a_delivery_on_a_stage_whose_cache_is_off_is_refused() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="asks for hidden-state files, but the cache is off here"):
        _configured(cache_on=False).resolve_consumer(SimpleNamespace())
    assert _configured(cache_on=False).resolve_consumer(None) == "discard"


def test_a_delivery_beside_a_cache_on_every_tp_rank_is_refused() -> None:
    """Every TP rank's cache would deliver the same requests' files (the second writer finds the first's
    lock and fails the delivery): refused at start, naming both settings; without delivery it stays."""
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\['all_tp_ranks'\] keeps a cache on every TP rank.*"
                                                           r"\['delivery_dir'\] needs the output rank's cache alone"):
        _configured({"all_tp_ranks": True}).resolve_consumer(SimpleNamespace())
    assert _configured({"all_tp_ranks": True}).resolve_consumer(None) == "discard"
    assert _configured({"all_tp_ranks": True, "consumer": "discard"}).resolve_consumer(None) == "discard"


def test_the_default_consumer_delivers_when_it_can_and_else_discards_saying_so(caplog) -> None:
    delivery = SimpleNamespace()
    bridge = _configured()
    assert bridge.resolve_consumer(delivery) == "deliver" and bridge.delivery is delivery and bridge.contained
    with caplog.at_level(logging.WARNING, logger="omni_cache.integration.vllm_bridge"):
        bridge = _configured()
        assert bridge.resolve_consumer(None) == "discard" and bridge.delivery is None and bridge.contained
    assert "no hidden-state rows leave this engine" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="omni_cache.integration.vllm_bridge"):
        assert _configured({"consumer": "discard"}).resolve_consumer(None) == "discard"
        queue = _configured({"consumer": "queue"})
        assert queue.resolve_consumer(None) == "queue" and queue.delivery is None and not queue.contained
    assert caplog.text == ""


@pytest.mark.parametrize("consumer", ["discard", "queue"])
def test_a_consumer_that_takes_the_step_ids_away_from_a_delivery_is_refused(consumer: str) -> None:
    """The connector's scheduler side would tell clients file paths no worker writes: refused at start."""
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"\['consumer'\]='{consumer}' takes every step id away from "
                                                           r"the delivery.*\['delivery_dir'\] promises clients"):
        _configured({"consumer": consumer}).resolve_consumer(SimpleNamespace())


def test_a_delivery_of_a_policy_without_hidden_states_is_refused() -> None:
    """A delivered file holds ``hidden_states``; a policy that caches none cannot fill it."""
    bridge = _configured({"needs_full_hidden_states": False})
    bridge.on_model_loaded(SimpleNamespace())
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"caches no hidden states.*\['delivery_dir'\] delivers "
                                                           "holds hidden_states"):
        bridge.resolve_consumer(SimpleNamespace())
    assert bridge.resolve_consumer(None) == "discard"  # no delivery: nothing promised


def test_an_unknown_consumer_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="must be one of deliver, discard, queue, got 'files'"):
        VllmRunnerBridge({"consumer": "files"})
