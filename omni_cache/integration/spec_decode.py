"""Speculative decoding in the vLLM runner bridge: the verdict of a verify step.

Owns: ``VerifyStep`` (a saved step whose requests carried draft tokens, held by the bridge
between the forward and sampling), ``Verdict`` (per request, how many of its rows the step
keeps; the draft tokens accepted and rejected; the rows cut) and ``verdict_of``, which
computes it from what vLLM's V1 runner knows once ``sample_tokens`` has run: the step's
scheduled draft tokens (``scheduler_output.scheduled_spec_decode_tokens``), the tokens the
rejection sampler kept (``ModelRunnerOutput.sampled_token_ids``) and the request's sampling
parameters. vLLM is imported lazily (``check_stop``), never at module scope.

How vLLM 0.32 runs a verify step (V1 ``GPUModelRunner``, which ``CPUModelRunner`` extends):
the scheduler schedules, for a request in decode, its last sampled token (position ``c``, not
computed yet) and the ``k`` drafts the proposer gave after the previous step
(``num_scheduled_tokens[r] = 1 + k``, the drafts in ``scheduled_spec_decode_tokens[r]``; a
new request whose prompt is cached but for one token is padded with ``k`` placeholder drafts
``-1``). The KV manager allocates slots for all of them but caches (hashes) blocks only up to
``request.num_tokens``, which excludes the drafts. ``execute_model`` runs the forward over
every scheduled token (the bridge saves the step here, rows of drafts included) and returns;
``sample_tokens`` runs the rejection sampler: the first ``a`` drafts that match the target's
tokens are accepted and one more token is sampled, so the request gets ``a + 1`` tokens
(``sampled_token_ids[i]``), then the proposer drafts the next ones. The scheduler's
``update_from_output`` rolls ``num_computed_tokens`` back by the ``k - a`` rejected drafts
and appends the tokens one by one, stopping at an end-of-sequence token, a stop token,
``max_tokens`` or ``max_model_len`` (``check_stop``) -- possibly inside the accepted drafts.
The next step schedules the request from position ``c + 1 + a`` (the sampled token), so the
KV slots of the rejected positions are written again, by the same request, with accepted tokens.

The verdict: a request with ``k`` drafts and ``n`` rows in the step keeps its first
``n - k + a`` rows (its sampled token's and the accepted drafts'); when the tokens stop at
the ``j``-th of the ``a + 1`` new ones, it keeps ``n - k + min(j - 1, a)`` -- one row per
token of the request's final output but the last, as a run without speculation computes.
No sampled token for a request with drafts (an output vLLM drops) keeps none of the drafts.

Upholds I14 on the producer side: every row the bridge hands on is a row of a token the
request has (``OmniPrefixCacheManager.trim_step`` cuts the rest before the step id leaves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.interface import ReqId, StepId

Spans = tuple[tuple[ReqId, int, int], ...]

__all__ = ["SampledTokens", "Verdict", "VerdictError", "VerifyStep", "VerifySteps", "bookkeeping_tokens", "drafts_of",
           "sampled_tokens", "verdict_of"]


@dataclass(frozen=True)
class VerifyStep:
    """A saved step whose requests carried drafts, waiting for sampling's verdict."""

    step_id: StepId
    engine_step: int
    spans: tuple[tuple[ReqId, int, int], ...]
    drafts: dict[ReqId, int]


@dataclass
class Verdict:
    """Rows kept per request (only those that lose rows), draft tokens accepted and rejected,
    rows cut (rejected drafts' and accepted ones past a stop)."""

    keep: dict[ReqId, int] = field(default_factory=dict)
    accepted: int = 0
    rejected: int = 0
    cut: int = 0

    def spans(self, spans: Sequence[tuple[ReqId, int, int]]) -> tuple[tuple[ReqId, int, int], ...]:
        """``spans`` with each request's end at its kept rows."""
        return tuple((r, s, s + self.keep[r] if r in self.keep else e) for r, s, e in spans)


def drafts_of(scheduler_output: Any) -> dict[ReqId, int]:
    """The draft tokens scheduled per request (placeholders ``-1`` included): their rows are in
    the step, their verdict comes with sampling."""
    scheduled = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return {rid: len(tokens) for rid, tokens in scheduled.items() if len(tokens)}


@dataclass(frozen=True)
class SampledTokens:
    """The sampled tokens of a step, per request in the runner's batch order."""

    req_ids: list[ReqId]
    sampled_token_ids: list[list[int]]


def bookkeeping_tokens(out: Any) -> SampledTokens:
    """The sampled tokens from what vLLM 0.32's ``GPUModelRunner._bookkeeping_sync`` returns
    (``valid_sampled_token_ids`` and ``req_ids_output_copy``, the 4th and 6th of its 8 values);
    ``TypeError`` for any other shape (another vLLM, async scheduling's empty lists)."""
    if not isinstance(out, tuple) or len(out) != 8 or not isinstance(out[3], list) or not isinstance(out[5], list):
        raise TypeError(f"_bookkeeping_sync returned {type(out).__name__} of {len(out) if isinstance(out, tuple) else '?'}"
                        " values: not vLLM 0.32's (..., valid_sampled_token_ids, _, req_ids, ...)")
    return SampledTokens(list(out[5]), [list(t) for t in out[3]])


def sampled_tokens(output: Any) -> dict[ReqId, list[int]]:
    """Per request, the tokens sampling kept this step (``ModelRunnerOutput``: ``req_ids`` and
    ``sampled_token_ids``); ``TypeError`` for an output whose tokens are still on the device
    (async scheduling, which the configuration gate refuses with speculative decoding)."""
    req_ids = getattr(output, "req_ids", None)
    sampled = getattr(output, "sampled_token_ids", None)
    if req_ids is None or not isinstance(sampled, list):
        raise TypeError(f"the runner's output {type(output).__name__} carries no sampled token lists: the "
                        "verdict of a verify step needs vLLM's synchronous ModelRunnerOutput")
    return {rid: list(tokens) for rid, tokens in zip(req_ids, sampled, strict=False)}


class _StopProbe:
    """The attributes of a vLLM ``Request`` that ``check_stop`` reads, for one request."""

    pooling_params = None

    def __init__(self, sampling_params: Any, num_prompt_tokens: int, outputs: Sequence[int]) -> None:
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.output_token_ids = list(outputs)
        self.status: Any = None
        self.stop_reason: Any = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def stop_index(state: Any, new_tokens: Sequence[int], max_model_len: int) -> int | None:
    """Where the scheduler will stop the request among ``new_tokens`` (1-based), or ``None``.

    ``state`` is the runner's ``CachedRequestState`` after bookkeeping (its ``output_token_ids``
    end with ``new_tokens``). The rule is vLLM's own ``check_stop``, applied token by token as
    ``Scheduler._update_request_with_output`` does."""
    params = getattr(state, "sampling_params", None)
    if params is None or getattr(params, "max_tokens", None) is None:
        return None
    from vllm.v1.core.sched.utils import check_stop

    outputs = list(state.output_token_ids)
    prior = outputs[: len(outputs) - len(new_tokens)] if outputs[len(outputs) - len(new_tokens):] == list(new_tokens) \
        else outputs
    probe = _StopProbe(params, int(state.num_prompt_tokens), prior)
    for j, token in enumerate(new_tokens, 1):
        probe.output_token_ids.append(int(token))
        if check_stop(probe, max_model_len):
            return j
    return None


def verdict_of(step: VerifyStep, sampled: Mapping[ReqId, Sequence[int]], requests: Mapping[ReqId, Any],
               max_model_len: int) -> Verdict:
    """The verdict of ``step`` (see the module docstring)."""
    verdict = Verdict()
    for rid, start, end in step.spans:
        k = step.drafts.get(rid, 0)
        if not k:
            continue
        n = end - start
        tokens = list(sampled.get(rid, ()))
        accepted = min(max(len(tokens) - 1, 0), k)
        verdict.accepted += accepted
        verdict.rejected += k - accepted
        kept = n - k + accepted
        state = requests.get(rid)
        if tokens and state is not None:
            stop = stop_index(state, tokens, max_model_len)
            if stop is not None:
                kept = n - k + min(stop - 1, accepted)
        if kept < n:
            verdict.keep[rid] = kept
            verdict.cut += n - kept
    return verdict


class VerdictError(OmniPrefixCacheUnmatchError):
    """A verify step's verdict could not be given (``step``: the step, never handed on)."""

    def __init__(self, step: VerifyStep, reason: str) -> None:
        super().__init__(f"engine step {step.engine_step}: the verdict of verify step {step.step_id} failed: {reason}")
        self.step = step


class VerifySteps:
    """The runner bridge's verify step held from its save to the end of sampling, and the counts.

    Engine thread only. ``hold`` keeps a saved step whose requests carried drafts; ``settle``
    (end of ``sample_tokens``) gives its verdict through ``manager.trim_step`` and returns it
    with its kept rows' spans, or raises ``VerdictError`` (the step is then no longer held);
    ``take`` hands back a step that never got a verdict."""

    def __init__(self) -> None:
        self.pending: VerifyStep | None = None
        self.counters = {"verify_steps": 0, "draft_tokens_accepted": 0, "draft_tokens_rejected": 0, "rows_trimmed": 0}

    def hold(self, step_id: StepId, engine_step: int, spans: Spans, scheduler_output: Any) -> bool:
        """Hold the step when its requests carried drafts (True), else leave it (False)."""
        drafts = drafts_of(scheduler_output)
        if not drafts:
            return False
        self.pending = VerifyStep(step_id, engine_step, spans, drafts)
        return True

    def take(self) -> VerifyStep | None:
        step, self.pending = self.pending, None
        return step

    def settle(self, output: Any, runner: Any, manager: Any) -> tuple[VerifyStep, Spans] | None:
        step = self.take()
        if step is None:
            return None
        try:
            verdict = verdict_of(step, sampled_tokens(output), runner.requests, int(runner.max_model_len))
            if verdict.keep:
                manager.trim_step(step.step_id, verdict.keep)
        except Exception as exc:  # whatever it is, the step gets no verdict (never handed on) and the cache fails
            raise VerdictError(step, f"{type(exc).__name__}: {exc}") from exc
        counters = self.counters
        counters["verify_steps"] += 1
        counters["draft_tokens_accepted"] += verdict.accepted
        counters["draft_tokens_rejected"] += verdict.rejected
        counters["rows_trimmed"] += verdict.cut
        return step, verdict.spans(step.spans)
