"""Protects the device setting of the stateful machines: ``$OMNI_CACHE_TEST_DEVICE`` reaches every
tensor they hand the manager, and a device torch cannot use is refused, never run on the CPU.

tools/device_check.sh runs tests/manager/test_manager_stateful.py, adapter/test_adapter_stateful.py and
tier/test_tier_stateful.py with ``OMNI_CACHE_TEST_DEVICE=cuda`` on a GPU machine. Here (no CUDA) the
chain is checked link by link: the setting is read by ``machine_device`` (cpu by default), the
machines read it when they start, the reference engine builds every step tensor (rows, padding,
leftovers) on its device, and pytest refuses a device it cannot use at start with one line. On a
GPU machine the ``cuda``-marked test runs a machine's steps with CUDA tensors for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE_ENV, machine_device
from manager_machine import AsyncMachine, ManagerMachine
from reference_model import CODES, EMBEDS, GRID, INFO, LENS, META, Engine
from tier_machine import TierMachine

from omni_cache import ModelCachePolicy, PrefixCacheConfig
from omni_cache.runtime.manager import OmniPrefixCacheManager

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
# One draw of ManagerMachine.setup's strategies: full hidden states, both mm keys, EMBEDS deferred.
SETUP = dict(hidden=True, defer=(EMBEDS,), pass_hidden=True, depth=2, budget=1 << 30, num_blocks=12,
             arrivals=[(0, 2, [1, 2], 2), (1, 1, [3], 0)], mru=False, slow=False)


def test_the_setting_defaults_to_cpu_and_refuses_what_is_not_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert machine_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert machine_device() == torch.device("cpu")
    for bad in ("tpu", "gpu", "meta"):
        monkeypatch.setenv(DEVICE_ENV, bad)
        with pytest.raises(ValueError, match=f"{DEVICE_ENV}={bad}: must be cpu or cuda"):
            machine_device()


@NO_CUDA
def test_cuda_without_a_device_is_refused_not_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{DEVICE_ENV}=cuda: no CUDA device"):
        machine_device()
    with pytest.raises(ValueError, match="no CUDA device"):  # the machine reads it when it starts
        ManagerMachine().setup(**SETUP)


def test_the_engine_builds_every_tensor_it_hands_the_manager_on_its_device() -> None:
    """The reference engine's step (rows, padding, padded mm, leftovers) on the ``meta`` device:
    every tensor of it is there, so none is left on the CPU when the device is cuda."""
    cfg = PrefixCacheConfig(num_blocks=12, block_size=4, staging_depth=2, staging_capacity_tokens=16)
    m = OmniPrefixCacheManager(cfg, eager=True)
    engine = Engine(m, cfg, ModelCachePolicy(deferred_keys=frozenset({EMBEDS})), device="meta")
    engine.add_request(0, 2, [1, 2], 0)
    engine.add_request(1, 1, [3], 0)
    prepared = engine.prepare([(0, 5), (1, 3)], pad=3, leftover=True, padded_mm=True)
    assert prepared is not None and prepared.total == 8 and prepared.padded == 11
    tensors = {"hidden": prepared.hidden, CODES: prepared.mm[CODES], EMBEDS: prepared.mm[EMBEDS],
               LENS: prepared.mm[LENS], GRID: prepared.mm[GRID], INFO: prepared.mm[INFO]["rows"]}
    assert {k: t.device.type for k, t in tensors.items()} == dict.fromkeys(tensors, "meta")
    assert prepared.hidden.shape[0] == 11 and prepared.mm[CODES].shape[0] == 11
    assert isinstance(prepared.mm[META], list)
    m.shutdown()


def test_the_machines_start_their_engine_on_the_configured_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the setting at cuda (torch told a device exists), the manager machine's engine and the
    tier machine take cuda when they start; nothing is allocated before a step runs."""
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine = ManagerMachine()  # eager: its manager makes no CUDA stream
    machine.setup(**SETUP)
    assert machine.engine.device == torch.device("cuda")
    assert machine.m is not None and not machine.m.use_cuda
    machine.m.shutdown()
    tier = TierMachine()
    tier.setup()
    assert tier.device == torch.device("cuda")
    tier.m.shutdown()
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    machine = ManagerMachine()
    machine.setup(**SETUP)
    assert machine.engine.device == torch.device("cpu")
    machine.m.shutdown()


def _pytest_with(device: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, DEVICE_ENV: device}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co",
                           "tests/project/test_machine_device.py::test_the_setting_defaults_to_cpu_and_refuses_what_is_not_a_device"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("device, line", [
    pytest.param("cuda", f"{DEVICE_ENV}=cuda: no CUDA device", marks=NO_CUDA, id="cuda"),
    pytest.param("tpu", f"{DEVICE_ENV}=tpu: must be cpu or cuda", id="tpu"),
])
def test_pytest_refuses_a_device_it_cannot_use_at_start(device: str, line: str) -> None:
    done = _pytest_with(device)
    assert done.returncode == 4, (done.returncode, done.stdout[-800:], done.stderr[-800:])  # pytest's usage error
    assert f"ERROR: {line}" in done.stderr, done.stderr[-800:]


def test_the_report_header_names_the_device() -> None:
    done = _pytest_with("cpu")
    assert done.returncode == 0, done.stdout[-800:]
    assert "omni-cache test device (OMNI_CACHE_TEST_DEVICE): cpu" in done.stdout


# ---- the machines run: every save gets tensors on the configured device ---------------------------
def _devices_saved(monkeypatch: pytest.MonkeyPatch, device: str) -> set[str]:
    """Run the async manager machine (a few short programs) with the setting at ``device``; the
    device types of the tensors every save_outputs call received."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    monkeypatch.setenv(DEVICE_ENV, device)
    seen: set[str] = set()
    inner = OmniPrefixCacheManager.save_outputs

    def spy(self: OmniPrefixCacheManager, hidden: torch.Tensor | None, mm: dict[str, object] | None,
            **kw: object) -> int:
        seen.update(t.device.type for t in [hidden, *(mm or {}).values()] if isinstance(t, torch.Tensor))
        return inner(self, hidden, mm, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(OmniPrefixCacheManager, "save_outputs", spy)
    run_state_machine_as_test(AsyncMachine, settings=settings(max_examples=3, stateful_step_count=12, deadline=None,
                                                              database=None, derandomize=True,
                                                              suppress_health_check=list(HealthCheck)))
    return seen


def test_the_machines_save_tensors_of_the_setting_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices_saved(monkeypatch, "cpu") == {"cpu"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_the_machines_save_cuda_tensors_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices_saved(monkeypatch, "cuda") == {"cuda"}
