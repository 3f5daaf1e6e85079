"""The checks of ``omni-cache pipeline``: talker outputs against the ground truth, and the controls.

Owns: ``compare`` (one request: the talker's tokens must be equal and each
sampled token's logprob within ``tolerance`` of the ground truth's),
``Verdict`` (the counted result of comparing a set of requests),
``perturb_row`` (negative control (ii): one prefix row shifted by a fixed
fraction of its own largest magnitude) and ``row_diff`` (the largest relative
difference between the rows the talker got and the ground truth's rows).
A control is caught when the comparison flags every request it changed, so a
check that cannot fail would show here as an uncaught control. Pure torch;
no vLLM. Checks the end-to-end consequence of I4, I6 and I7 (the served
prefix rows are the rows the prefix's tokens produce).

Upholds nothing itself: it checks I4, I6 and I7 from outside (a wrong row changes the talker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["DEFAULT_LOGPROB_TOLERANCE", "PERTURBATION", "Comparison", "Verdict", "compare", "compare_all",
           "perturb_row", "row_diff"]

DEFAULT_LOGPROB_TOLERANCE = 1e-4  # absolute, per sampled token; see docs/pipeline.md
PERTURBATION = 0.05  # control (ii): the row plus 5% of its largest |value|, every element


class TalkerResult(Protocol):
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Comparison:
    name: str
    tokens_equal: bool
    max_logprob_diff: float
    tolerance: float
    detail: str = ""

    @property
    def identical(self) -> bool:
        return self.tokens_equal and self.max_logprob_diff <= self.tolerance


def compare(name: str, truth: TalkerResult, got: TalkerResult, tolerance: float) -> Comparison:
    """``got`` against ``truth``: tokens equal, and every logprob within ``tolerance``."""
    tokens_equal = tuple(got.tokens) == tuple(truth.tokens)
    if len(got.logprobs) != len(truth.logprobs):
        return Comparison(name, False, float("inf"), tolerance,
                          f"{len(got.logprobs)} logprobs, ground truth {len(truth.logprobs)}")
    diffs = [abs(a - b) for a, b in zip(got.logprobs, truth.logprobs, strict=True)]
    worst = float("inf") if any(d != d for d in diffs) else max(diffs, default=0.0)  # a NaN is never identical
    detail = ""
    if not tokens_equal:
        first = next((i for i, (a, b) in enumerate(zip(got.tokens, truth.tokens, strict=False)) if a != b),
                     min(len(got.tokens), len(truth.tokens)))
        detail = f"tokens differ from output position {first}: {list(got.tokens)} vs {list(truth.tokens)}"
    elif worst > tolerance:
        detail = f"logprob differs by {worst:.3g} (tolerance {tolerance:g})"
    return Comparison(name, tokens_equal, worst, tolerance, detail)


@dataclass
class Verdict:
    """Comparisons of a set of requests, counted."""

    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def compared(self) -> int:
        return len(self.comparisons)

    @property
    def identical(self) -> int:
        return sum(c.identical for c in self.comparisons)

    @property
    def differing(self) -> int:
        return self.compared - self.identical

    @property
    def all_identical(self) -> bool:
        return self.compared > 0 and self.differing == 0

    @property
    def all_differ(self) -> bool:
        """A control is caught: every request it changed is flagged."""
        return self.compared > 0 and self.identical == 0

    @property
    def max_logprob_diff(self) -> float:
        return max((c.max_logprob_diff for c in self.comparisons), default=0.0)

    @property
    def min_logprob_diff(self) -> float:
        return min((c.max_logprob_diff for c in self.comparisons), default=0.0)

    @property
    def tokens_differ(self) -> int:
        return sum(not c.tokens_equal for c in self.comparisons)


def compare_all(truth: Mapping[str, TalkerResult], got: Mapping[str, TalkerResult], tolerance: float,
                names: dict[str, str] | None = None) -> Verdict:
    """Compare ``got[k]`` with ``truth[names.get(k, k)]`` for every ``k`` in ``got``; a request
    missing from the ground truth is a difference."""
    names = names or {}
    out = Verdict()
    for k, res in got.items():
        ref = truth.get(names.get(k, k))
        if ref is None:
            out.comparisons.append(Comparison(k, False, float("inf"), tolerance, "no ground-truth output"))
        else:
            out.comparisons.append(compare(k, ref, res, tolerance))
    return out


def perturb_row(rows: torch.Tensor, position: int, fraction: float = PERTURBATION) -> torch.Tensor:
    """A copy of ``rows`` whose row ``position`` has ``fraction`` of its largest |value| added to every element."""
    if not 0 <= position < rows.shape[0]:
        raise ValueError(f"position {position} outside the {rows.shape[0]} rows")
    out = rows.clone()
    out[position] = out[position] + fraction * out[position].abs().max()
    if torch.equal(out[position], rows[position]):
        raise ValueError(f"row {position} is unchanged by the perturbation (all zeros?)")
    return out


def row_diff(got: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest, over rows, of max |got - truth| / max |truth| (inf when the shapes differ)."""
    if got.shape != truth.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    diff = (got.float() - truth.float()).abs().amax(dim=-1)
    scale = truth.float().abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return float((diff / scale).max())
