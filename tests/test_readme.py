"""The README stays true: its worked example runs, and .ci/run runs its test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _command_after(heading: str) -> str:
    match = re.search(rf"\*\*{re.escape(heading)}\*\*.*?\n\n    (.+?)\n", README, re.S)
    assert match, f"README has no indented command after **{heading}**"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = _command_after("Run the tests")
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    assert command in lines
    assert "torch==2.13.0" in command and "pytest" in command


def test_main_job_command_pins_torch_and_runs_simulate() -> None:
    command = _command_after("Run the main job")
    assert "torch==2.13.0" in command and command.endswith("omni-cache simulate")


def test_worked_example_runs() -> None:
    match = re.search(r"## The per-step protocol in \d+ lines\n\n```python\n(.*?)```", README, re.S)
    assert match
    code = match.group(1)
    assert 20 <= len(code.splitlines()) <= 30
    exec(compile(code, "README.md", "exec"), {})
