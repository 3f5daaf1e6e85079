"""The TLC half of trace validation: one generated trace spec run through TLC, and its verdict.

Owns: ``TraceCheck`` (TLC's verdict on a trace: accepted, or the event it got stuck at),
``run_trace_spec`` (copy a model's modules and the generated trace data into a temporary
folder and run TLC there), ``trace_cfg`` and ``tla_string``. Both trace checkers use it:
``omni_cache.verify.traces`` (staging and writes) and ``omni_cache.verify.tenancy_trace``
(tenancy), neither importing the other's internals.

Upholds (by checking runtime traces): whatever invariants the trace spec's cfg names (I1, I2,
I3, I6, I7, I8, I9 for the three trace specs).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omni_cache.verify.tlc import EXIT_DEADLOCK, EXIT_OK, parse_tlc_output, run_tlc

_L_RE = re.compile(r"^/\\ l = (\d+)$", re.M)


def tla_string(text: str) -> str:
    return json.dumps(text)  # a JSON string of ASCII text is a TLA+ string literal


def trace_cfg(constants: dict[str, int], invariants: str, properties: str = "",
              substitutions: tuple[str, ...] = ()) -> str:
    """A trace spec's TLC cfg: its constants (and ``name <- def`` substitutions), the real invariants
    and action properties checked along the trace."""
    lines = [f"    {k} = {v}" for k, v in constants.items()] + [f"    {sub}" for sub in substitutions]
    text = "CONSTANTS\n" + "\n".join(lines) + f"\nSPECIFICATION TraceSpec\nINVARIANTS {invariants}\n"
    return text + (f"PROPERTIES {properties}\n" if properties else "")


@dataclass(frozen=True)
class TraceCheck:
    """TLC's verdict on a trace: accepted, or where it got stuck."""

    accepted: bool
    exit_code: int
    result: str
    num_events: int
    stuck_at: int | None
    output: str

    def explain(self) -> str:
        if self.accepted:
            return f"TLC accepted the trace ({self.num_events} events)"
        where = f" at event #{self.stuck_at}" if self.stuck_at is not None else ""
        return f"TLC rejected the trace{where}: {self.result} (exit {self.exit_code})"


def run_trace_spec(
    folder: Path, modules: tuple[str, ...], spec: str, data: str, cfg: str, num_events: int, timeout_s: float
) -> TraceCheck:
    with tempfile.TemporaryDirectory(prefix="omni-trace-") as tmp:
        work = Path(tmp)
        for module in modules:
            shutil.copy(folder / module, work / module)
        (work / f"{spec}Data.tla").write_text(data)
        (work / f"{spec}.cfg").write_text(cfg)
        run = run_tlc(work / f"{spec}.tla", work / f"{spec}.cfg", workdir=work / "tlc", timeout_s=timeout_s)
    outcome = parse_tlc_output(run.output, run.exit_code, cfg)
    stuck = None
    if run.exit_code in (EXIT_DEADLOCK, 12, 13):
        ls = _L_RE.findall(run.output)
        if ls:  # l: the 1-based next event; a deadlock is stuck at it, an invariant broke at l - 1
            stuck = int(ls[-1]) - 1 - (0 if run.exit_code == EXIT_DEADLOCK else 1)
    return TraceCheck(
        accepted=run.exit_code == EXIT_OK and outcome.result == "ok",
        exit_code=run.exit_code, result=outcome.result, num_events=num_events,
        stuck_at=stuck, output=run.output[-4000:],
    )
