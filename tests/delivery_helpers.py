"""Shared set-up of the delivery tests: a served engine's two halves on the integration fakes.

Owns: ``ServedLoop`` -- ``fakes_vllm_engine.FakeScheduler`` with a ``DeliveryScheduler`` on the
scheduler side, a ``FakeModelRunner`` that calls ``VllmRunnerBridge`` where vLLM's V1 runner does
(``begin_step``, the forward, ``after_forward_v1``) with a ``RowDelivery`` on the worker side, and
the ``OmniKVConnector`` calls between them in vLLM's order (the plan built at schedule time;
``finish_step`` and ``take_results`` after the forward; ``finish`` for each request the step
finished, then ``absorb``). Rows are ``fakes_vllm.truth_rows`` (a function of the tokens up to the
position), so every file's content is known in advance (``expected_rows``). Also the disks that
misbehave (``FullDisk``: ENOSPC; ``HeldDisk``: each write waits for the test) and ``read``.
"""

from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace
from typing import Any

import torch
from fakes_vllm import token_at, truth_rows
from fakes_vllm_engine import FakeModelRunner, FakeScheduler
from safetensors.torch import load_file

from omni_cache.integration.delivery import RowDelivery
from omni_cache.integration.delivery_files import DeliveryStore
from omni_cache.integration.delivery_sched import DeliveryScheduler
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.integration.runner_hooks import PrefixCacheRunnerHooks
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.interface import PrefixCacheConfig

NONCE = "feedc0ffee00"
MM_KEY = "audio.codes"
JOIN_S = 20.0


def codes_of(hidden: torch.Tensor) -> torch.Tensor:
    """The per-token mm key the loop's model emits beside its hidden rows (padding rows too)."""
    return -hidden[:, :2].clone()


def expected_rows(prompt: list[int], num_tokens: int) -> torch.Tensor:
    return truth_rows(prompt, 0, num_tokens)


def expected_ids(prompt: list[int], num_tokens: int) -> torch.Tensor:
    return torch.tensor([token_at(prompt, p) for p in range(num_tokens)], dtype=torch.long)


def read(path: str) -> dict[str, torch.Tensor]:
    return load_file(path, device="cpu")


class FullDisk(DeliveryStore):
    """Every file write fails as a full disk does (lock files and notes still work)."""

    def write(self, path: str, payload: bytes, *, publish: Any = None) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", path)


class HeldDisk(DeliveryStore):
    """Each file write waits until the test sets ``gate`` (a slow or stuck disk), then writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.waiting = 0
        self.done = 0
        self._count = threading.Lock()

    def write(self, path: str, payload: bytes, *, publish: Any = None) -> int:
        with self._count:
            self.waiting += 1
        try:
            assert self.gate.wait(JOIN_S), "the test never opened the disk"
            return super().write(path, payload, publish=publish)
        finally:
            with self._count:
                self.done += 1


class _BridgeRunner(FakeModelRunner):
    """``FakeModelRunner`` calling the bridge as vLLM's V1 runner does."""

    def __init__(self, bridge: VllmRunnerBridge, *, block_size: int) -> None:
        super().__init__(bridge, block_size=block_size)
        for table in self.input_batch.block_table.block_tables:  # the engine's slot mapping: observers only
            table.slot_mapping = SimpleNamespace(gpu=torch.zeros(4096, dtype=torch.int64))

    def execute_model(self, so: Any) -> Any:
        self.hooks.begin_step(so)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        hidden, _, _, padded = self.forward(so)
        ids = torch.zeros(padded, dtype=torch.int64)
        return self.hooks.after_forward_v1(self, hidden, ids, ids)


class ServedLoop:
    """One served engine on the fakes (see the module docstring)."""

    def __init__(self, directory: str, *, block_size: int = 4, num_blocks: int = 64, max_batched: int = 64,
                 consumer: str | None = None, store: DeliveryStore | None = None, mm: bool = False,
                 hooks: PrefixCacheRunnerHooks | None = None, deliver: bool = True, claim: bool = True,
                 **settings: Any) -> None:
        settings.setdefault("delivery_timeout_s", 60.0)  # a loaded machine never fails a healthy write
        self.settings = DeliverySettings(delivery_dir=os.path.realpath(directory), nonce=NONCE, **settings)
        self.scheduler = FakeScheduler(num_blocks=num_blocks, block_size=block_size,
                                       max_num_batched_tokens=max_batched)
        # ``deliver=False``: an engine without delivery (no connector's scheduler or worker side)
        self.dsched: Any = DeliveryScheduler(self.settings) if deliver else None
        self.delivery: Any = RowDelivery(self.settings, store=store, claim=claim) if deliver else None
        hooks = hooks or PrefixCacheRunnerHooks(is_last_pp_rank=True, eager=True)
        self.bridge = VllmRunnerBridge({} if consumer is None else {"consumer": consumer}, hooks=hooks)
        self.bridge.hooks.configure(PrefixCacheConfig(num_blocks=num_blocks, block_size=block_size,
                                                      staging_capacity_tokens=max_batched * 2,
                                                      staging_claim_timeout_s=2.0))
        self.bridge.on_model_loaded(SimpleNamespace())
        self.bridge.resolve_consumer(self.delivery)
        if mm:
            self.bridge.mm_outputs_fn = lambda hidden: {MM_KEY: codes_of(hidden)}
        self.runner = _BridgeRunner(self.bridge, block_size=block_size)
        self.prompts: dict[str, list[int]] = {}
        self.kv_params: dict[str, dict[str, Any]] = {}  # the request's kv_transfer_params
        self.outputs: dict[str, dict[str, Any] | None] = {}  # the finished request's kv_transfer_params
        self.steps = 0

    @property
    def manager(self) -> Any:
        return self.bridge.hooks.manager

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1, **kv_params: Any) -> None:
        self.prompts[req_id] = list(prompt)
        self.kv_params[req_id] = kv_params
        self.scheduler.add_request(req_id, list(prompt), max_tokens)

    def abort(self, req_id: str) -> None:
        request = self.scheduler.requests[req_id]
        self.scheduler.abort(req_id)
        request.status = SimpleNamespace(name="FINISHED_ABORTED")
        if self.dsched is not None:
            self.outputs[req_id] = self.dsched.finish(request)

    def step(self, preempt: tuple[str, ...] = ()) -> Any:
        so = self.scheduler.schedule(preempt=preempt)
        for new in so.scheduled_new_reqs:
            params = self.kv_params.get(new.req_id)
            new.sampling_params = SimpleNamespace(extra_args={"kv_transfer_params": params} if params else None)
        if self.dsched is None:  # no delivery: the step alone; a finished request has no outcome to give
            live = dict(self.scheduler.requests)
            self.runner.execute_model(so)
            self.scheduler.update_from_output(so)
            self.outputs.update((r, None) for r in live if r not in self.scheduler.requests and r not in self.outputs)
            self.steps += 1
            return so
        so.kv_connector_metadata = SimpleNamespace(omni_delivery=self.dsched.build_plan(so))
        live = dict(self.scheduler.requests)
        self.runner.execute_model(so)
        self.delivery.finish_step()  # wait_for_save
        results = self.delivery.take_results()  # build_connector_worker_meta
        self.scheduler.update_from_output(so)
        for req_id, request in live.items():  # request_finished, while the scheduler processes the output
            if req_id not in self.scheduler.requests and req_id not in self.outputs:
                self.outputs[req_id] = self.dsched.finish(request)
        self.dsched.absorb(results)  # update_connector_output, afterwards
        self.steps += 1
        return so

    def run(self, max_steps: int = 200) -> None:
        """Step until every request finished, then once more (an include_output_tokens file is
        written in the step after its request finished)."""
        while self.scheduler.requests or self.scheduler.waiting:
            assert self.steps < max_steps, "the loop did not finish"
            self.step()
        self.step()

    def path_of(self, req_id: str) -> str:
        params = self.outputs[req_id]
        assert params is not None and "hidden_states_path" in params, params
        return params["hidden_states_path"]

    def close(self) -> dict[int, str]:
        if self.delivery is not None:
            self.delivery.shutdown()
        return self.bridge.shutdown()
