"""The scheduler half of delivery: which file each request gets, and what its output says.

Owns: ``DeliveryScheduler`` -- per live request its ``DeliveryTarget`` (decided when the
request is first scheduled: the default name under the delivery directory, or a client-given
``kv_transfer_params["hidden_states_path"]`` when the operator allows it), the outcomes the
worker reported (``DeliveryResult``), the ``include_output_tokens`` requests that finished and
whose files the worker writes next step, and the ``kv_transfer_params`` of finished requests
whose outcome arrives in the same engine step. It runs in the engine core's scheduler (the
``OmniKVConnector`` scheduler role), reads vLLM's objects by attribute name and imports
nothing of vLLM.

How the outcome reaches the client: vLLM's scheduler calls ``request_finished`` (here:
``finish``) while it processes a step's output, and only afterwards hands the connector that
step's worker output (``update_connector_output``, here: ``absorb``); the request's
``kv_transfer_params`` are serialised after both. A request whose file the worker wrote in that
same step (its prompt completed in the step that finished it) gets a dict from ``finish`` that
``absorb`` completes in place: ``hidden_states_path`` (and its row counts) or
``hidden_states_error``. Upholds: every finished request that was scheduled gets exactly one
of the two (an ``include_output_tokens`` file is written after the output: its path is given
and the reader waits on the file's lock); no request's output names a file another request's
rows went to (the worker writes each target once, ``DeliveryPaths`` makes names unique). Every
``hidden_states_error`` the scheduler itself writes (a request that ended before its file, an
outcome the worker never reported) is counted once in ``take_failures`` (the worker counts its own).
"""

from __future__ import annotations

import logging
from typing import Any

from omni_cache.integration.delivery import DeliveryPlan, DeliveryResult, DeliveryTarget
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.integration.request_check import request_params_problem

__all__ = ["DeliveryScheduler"]

log = logging.getLogger(__name__)


def _request_params(sampling_params: Any) -> dict[str, Any]:
    """The request's ``kv_transfer_params`` (vLLM keeps them in ``sampling_params.extra_args``)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return params if isinstance(params, dict) else {}


def _num_prompt_tokens(new_req: Any) -> int:
    ids = getattr(new_req, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    embeds = getattr(new_req, "prompt_embeds", None)
    return int(embeds.shape[0]) if embeds is not None else 0


class DeliveryScheduler:
    """The scheduler half of delivery (see the module docstring). Scheduler thread only."""

    def __init__(self, settings: DeliverySettings) -> None:
        self.settings = settings
        self.paths = settings.paths()
        self._targets: dict[str, DeliveryTarget] = {}  # live requests that were scheduled
        self._outcomes: dict[str, DeliveryResult] = {}  # reported before their request finished
        self._awaiting: dict[str, dict[str, Any]] = {}  # finished this step, outcome due in this step
        self._finished: list[tuple[str, tuple[int, ...]]] = []
        self._dropped: list[str] = []
        self._told: list[str] = []  # prompt-only requests that ended: their files' holds end
        self._failures = 0  # hidden_states_error outcomes made here, not yet taken by the metrics

    def build_plan(self, scheduler_output: Any) -> DeliveryPlan:
        """This step's news for the worker: targets of requests scheduled for the first time,
        finished ``include_output_tokens`` requests, dropped requests."""
        targets = []
        for new_req in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            req_id = new_req.req_id
            if req_id in self._targets:
                continue  # a resumed request keeps its target
            params = _request_params(getattr(new_req, "sampling_params", None))
            path, error = self.paths.target(req_id, params.get("hidden_states_path"))
            include = params.get("include_output_tokens")
            if (problem := request_params_problem(params)) is not None:  # a server without the API check
                path, error, include = None, problem, False
            elif include is None:  # absent, or JSON null: the server's setting
                include = self.settings.include_output_tokens
            target = DeliveryTarget(req_id, path, error, _num_prompt_tokens(new_req), include)
            self._targets[req_id] = target
            targets.append(target)
        plan = DeliveryPlan(tuple(targets), tuple(self._finished), tuple(self._dropped), tuple(self._told))
        self._finished, self._dropped, self._told = [], [], []
        return plan

    def finish(self, request: Any) -> dict[str, Any] | None:
        """``request_finished``: the ``kv_transfer_params`` entries of a finished request."""
        req_id = request.request_id
        target = self._targets.pop(req_id, None)
        outcome = self._outcomes.pop(req_id, None)
        if target is None:
            return None  # never scheduled (aborted while waiting): no rows, no file
        if not target.include_output_tokens:  # its prompt-only file, if written, is held until now
            self._told.append(req_id)
        if outcome is not None:
            return outcome.as_params()
        if target.include_output_tokens and target.path is not None and target.error is None:
            token_ids = tuple(int(t) for t in list(request.all_token_ids)[:-1])
            if len(token_ids) >= target.num_prompt_tokens and not _aborted(request):
                self._finished.append((req_id, token_ids))
                return {"hidden_states_path": target.path, "hidden_states_num_tokens": len(token_ids)}
        computed = int(getattr(request, "num_computed_tokens", 0))
        if computed < target.num_prompt_tokens or _aborted(request):
            self._dropped.append(req_id)
            how = "was aborted" if _aborted(request) else "ended"
            when = (f"after {computed} of its {target.num_prompt_tokens} prompt tokens"
                    if computed < target.num_prompt_tokens else "before its file was written")
            if target.error is None and target.path is not None:  # a refused target: the worker counted it
                self._failures += 1
            return {"hidden_states_error": f"request {req_id!r}: hidden states not delivered: the request {how} "
                                           f"{when}"}
        params: dict[str, Any] = {"hidden_states_path": target.path}
        self._awaiting[req_id] = params  # the worker wrote it this step: absorb completes it
        return params

    def absorb(self, results: tuple[DeliveryResult, ...] | None) -> None:
        """``update_connector_output``: the worker's outcomes of this step."""
        for result in results or ():
            params = self._awaiting.pop(result.req_id, None)
            if params is not None:
                _replace_ours(params, result.as_params())
            elif result.req_id in self._targets:
                self._outcomes[result.req_id] = result
            elif result.error is not None:  # include_output_tokens: the output went out already
                log.error("omni-cache delivery after the request's output: %s", result.error)
        for req_id, params in self._awaiting.items():  # never happens unless the worker lost a file
            self._failures += 1
            _replace_ours(params, {"hidden_states_error": f"request {req_id!r}: hidden states not delivered: the "
                                   "worker reported no outcome in the step the request finished"})
        self._awaiting.clear()

    def take_failures(self) -> int:
        """How many ``hidden_states_error`` outcomes the scheduler wrote since the last call (the
        ``delivery_failures`` the worker cannot see: it was never told, or never answered)."""
        failures, self._failures = self._failures, 0
        return failures


_OUR_KEYS = ("hidden_states_path", "hidden_states_error", "hidden_states_num_tokens", "hidden_states_cached_tokens")


def _replace_ours(params: dict[str, Any], ours: dict[str, Any]) -> None:
    """Swap our entries of ``params`` (a wrapped connector's stay) for ``ours``, in place."""
    for key in _OUR_KEYS:
        params.pop(key, None)
    params.update(ours)


def _aborted(request: Any) -> bool:
    status = getattr(request, "status", None)
    return "ABORTED" in str(getattr(status, "name", status))
