"""Hypothesis profiles for the whole suite: ``ci``, ``dev`` and ``nightly``.

Owns: the profile registry and which profile loads. Selected by the
``HYPOTHESIS_PROFILE`` environment variable; the default is ``ci`` when
``CI=true`` (or any value Hypothesis treats as CI), else ``dev``.

* ``ci``: registered with Hypothesis' own built-in ``ci`` profile as parent
  (which Hypothesis auto-loads when ``CI`` is set): derandomized, no example
  database, no deadline; sized so the whole suite stays within a few minutes on
  two cores.
* ``dev``: the local default: random, with the local example database (so a
  failure found once is replayed first next time), a little more work than ci.
* ``nightly``: random, no database, many more examples and longer stateful runs
  (and a longer soak, see tests/manager/test_soak.py).
* ``mutation``: ``ci`` without the shrink phase, for tools/mutation_check.py.

It also checks ``$OMNI_CACHE_TEST_DEVICE`` (tests/cache_helpers.py's ``machine_device``: where the
stateful machines build their tensors) once at start: a device torch cannot use ends the run
with one line (pytest's usage error), and the report header names the device in use.

Invariants touched: none directly; this sizes the property tests of I1..I13.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_CI_VALUES = {"1", "true", "yes"}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in _CI_VALUES or "GITHUB_ACTIONS" in os.environ


settings.register_profile(
    "ci",
    parent=settings.get_profile("ci"),
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=16,
    stateful_step_count=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=30,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    derandomize=False,
    database=None,
    deadline=None,
    max_examples=150,
    stateful_step_count=100,
    phases=tuple(Phase),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# tools/mutation_check.py: the ci profile without shrinking (a mutant needs one failure, not a minimal one).
settings.register_profile(
    "mutation",
    parent=settings.get_profile("ci"),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _in_ci() else "dev")
settings.load_profile(PROFILE)


def _device_setting() -> str:
    return os.environ.get("OMNI_CACHE_TEST_DEVICE", "").strip() or "cpu"


def pytest_configure(config: object) -> None:
    if _device_setting() != "cpu":  # torch only when asked for a device (the default needs no check)
        import pytest
        from cache_helpers import machine_device

        try:
            machine_device()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_report_header() -> list[str]:
    lines = [f"hypothesis profile: {PROFILE} ({settings.default})"]
    device = _device_setting()
    if device != "cpu":
        import torch

        device += f" ({torch.cuda.get_device_name(torch.device(device))})"
    return [*lines, f"omni-cache test device (OMNI_CACHE_TEST_DEVICE): {device}"]
