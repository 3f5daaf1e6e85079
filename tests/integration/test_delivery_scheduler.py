"""The scheduler half of delivery (``DeliveryScheduler``) and the delivery settings.

Protected first: every finished request that was scheduled gets exactly one of
``hidden_states_path`` (with its row counts) or ``hidden_states_error`` in its
``kv_transfer_params``, and that entry is the worker's outcome for *that* request -- reported
before the finish, or completed in place (the very dict vLLM serialises) when it arrives in the
step that finished the request, keeping a wrapped connector's own entries; a missing outcome
becomes an error, never a path to a file that is not there. A request gets its target on its
first schedule only (a resumed one keeps its path), with the client's path and
``include_output_tokens`` applied by the rules; aborted requests and requests that ended before
their prompt was computed are dropped (the worker forgets them) with an error; a request never
scheduled gets nothing. Then the settings: ``DeliverySettings.from_settings`` refuses each bad
value with one ``ValueError`` naming the key (wrong types, a bool for a number, NaN, inf, huge,
<= 0, a fraction for an integer, delivery keys without ``delivery_dir``), and
``connector_settings.tier_settings`` accepts delivery without a wrapped connector. The duck-typed requests
and scheduler outputs carry the attribute names vLLM 0.32's objects have.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_cache.integration.connector_settings import tier_settings
from omni_cache.integration.delivery import DeliveryPlan, DeliveryResult
from omni_cache.integration.delivery_paths import delivery_name
from omni_cache.integration.delivery_sched import DeliveryScheduler
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError

NONCE = "abcdefabcdef"


def _settings(tmp_path: Path, **kw: Any) -> DeliverySettings:
    return DeliverySettings(delivery_dir=os.path.realpath(tmp_path), nonce=NONCE, **kw)


def _new(req_id: str, n: int = 8, **params: Any) -> SimpleNamespace:
    extra = {"kv_transfer_params": params} if params else None
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(n)),
                           sampling_params=SimpleNamespace(extra_args=extra))


def _so(*new: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=list(new))


def _request(req_id: str, *, prompt: int = 8, outputs: int = 3, computed: int | None = None,
             aborted: bool = False) -> SimpleNamespace:
    computed = prompt + outputs - 1 if computed is None else computed
    status = SimpleNamespace(name="FINISHED_ABORTED" if aborted else "FINISHED_LENGTH_CAPPED")
    return SimpleNamespace(request_id=req_id, all_token_ids=list(range(100, 100 + prompt + outputs)),
                           num_computed_tokens=computed, status=status)


def _ok(req_id: str, path: str, n: int = 8, cached: int = 4) -> DeliveryResult:
    return DeliveryResult(req_id, path, None, n, cached, 1234, 0.01)


# ------------------------------------------------------------------------------------ targets
def test_a_request_gets_its_target_on_its_first_schedule_only(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    plan = sched.build_plan(_so(_new("a", 8), _new("b", 5)))
    assert [(t.req_id, t.path, t.error, t.num_prompt_tokens, t.include_output_tokens) for t in plan.targets] == [
        ("a", os.path.join(sched.paths.root, delivery_name("a", NONCE)), None, 8, False),
        ("b", os.path.join(sched.paths.root, delivery_name("b", NONCE)), None, 5, False)]
    # preempted and back through scheduled_new_reqs (Model Runner V2), with another path asked for
    assert not sched.build_plan(_so(_new("a", 8, hidden_states_path="other.safetensors")))
    assert not sched.build_plan(SimpleNamespace(scheduled_new_reqs=None))


def test_a_prompt_of_embeddings_counts_its_rows(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    new = SimpleNamespace(req_id="e", prompt_token_ids=None, prompt_embeds=SimpleNamespace(shape=(6, 32)),
                          sampling_params=None)
    (target,) = sched.build_plan(_so(new)).targets
    assert target.num_prompt_tokens == 6 and target.error is None


@pytest.mark.parametrize("extra_args", [None, {}, {"kv_transfer_params": None}, {"kv_transfer_params": "x"},
                                        "not a dict"])
def test_missing_or_odd_request_params_mean_the_defaults(tmp_path: Path, extra_args: Any) -> None:
    sched = DeliveryScheduler(_settings(tmp_path, include_output_tokens=True))
    new = SimpleNamespace(req_id="a", prompt_token_ids=[1, 2], sampling_params=SimpleNamespace(extra_args=extra_args))
    (target,) = sched.build_plan(_so(new)).targets
    assert target.path == sched.paths.default_path("a") and target.include_output_tokens and target.error is None


def test_a_client_path_follows_the_operators_rule(tmp_path: Path) -> None:
    closed = DeliveryScheduler(_settings(tmp_path))
    (target,) = closed.build_plan(_so(_new("a", hidden_states_path="mine.safetensors"))).targets
    assert (target.path, target.error) == (closed.paths.default_path("a"), None)
    opened = DeliveryScheduler(_settings(tmp_path, allow_custom_save_path=True))
    mine, outside = opened.build_plan(_so(_new("a", hidden_states_path="mine.safetensors"),
                                          _new("b", hidden_states_path="../b.safetensors"))).targets
    assert (mine.path, mine.error) == (os.path.join(opened.paths.root, "mine.safetensors"), None)
    assert outside.path is None and "outside the delivery directory" in outside.error


def test_include_output_tokens_per_request_and_by_default(tmp_path: Path) -> None:
    off = DeliveryScheduler(_settings(tmp_path))
    on = DeliveryScheduler(_settings(tmp_path, include_output_tokens=True))
    plan_off = off.build_plan(_so(_new("a"), _new("b", include_output_tokens=True)))
    plan_on = on.build_plan(_so(_new("a"), _new("b", include_output_tokens=False)))
    assert [t.include_output_tokens for t in plan_off.targets] == [False, True]
    assert [t.include_output_tokens for t in plan_on.targets] == [True, False]
    (bad,) = off.build_plan(_so(_new("c", include_output_tokens="yes"))).targets
    assert bad.path is None and "include_output_tokens must be true or false" in bad.error
    # JSON null (a client's unset field) is the server's setting, as an absent key is
    unset_off, unset_on = (sched.build_plan(_so(_new("d", include_output_tokens=None))).targets[0] for sched in (off, on))
    assert (unset_off.include_output_tokens, unset_on.include_output_tokens) == (False, True)
    assert unset_off.error is None and unset_off.path == off.paths.default_path("d")


# --------------------------------------------------------------------------- finish and absorb
def test_an_outcome_reported_before_the_finish_is_what_the_request_gets(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    (target,) = sched.build_plan(_so(_new("a"))).targets
    sched.absorb((_ok("a", target.path),))  # written in the step that computed the prompt
    assert sched.finish(_request("a")) == {"hidden_states_path": target.path, "hidden_states_num_tokens": 8,
                                           "hidden_states_cached_tokens": 4}
    assert sched.finish(_request("a")) is None  # once


def test_an_outcome_due_in_the_finishing_step_completes_the_same_dict(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    a, b = sched.build_plan(_so(_new("a"), _new("b"))).targets
    params_a = sched.finish(_request("a", outputs=1))
    params_b = sched.finish(_request("b", outputs=1))
    assert params_a == {"hidden_states_path": a.path}
    params_a["remote_block_ids"] = [3, 4]  # a wrapped connector's entry, merged into our dict
    sched.absorb((DeliveryResult("b", None, "request 'b': hidden states not delivered: disk full"),
                  _ok("a", a.path)))
    assert params_a == {"hidden_states_path": a.path, "hidden_states_num_tokens": 8, "hidden_states_cached_tokens": 4,
                        "remote_block_ids": [3, 4]}
    assert params_b == {"hidden_states_error": "request 'b': hidden states not delivered: disk full"}
    assert b.path is not None


def test_a_missing_outcome_becomes_an_error_never_a_path(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    sched.build_plan(_so(_new("a")))
    params = sched.finish(_request("a", outputs=1))
    sched.absorb(None)
    assert list(params) == ["hidden_states_error"] and "reported no outcome" in params["hidden_states_error"]
    sched.absorb(())  # settled: nothing left waiting
    assert list(params) == ["hidden_states_error"]
    assert sched.take_failures() == 1 and sched.take_failures() == 0  # a delivery failure, counted once


@pytest.mark.parametrize(("how", "said"), [
    ("aborted", "the request was aborted before its file was written"),
    ("aborted early", "the request was aborted after 5 of its 8 prompt tokens"),
    ("prompt not computed", "the request ended after 5 of its 8 prompt tokens"),
])
def test_a_request_that_ended_early_is_dropped_with_an_error(tmp_path: Path, how: str, said: str) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    sched.build_plan(_so(_new("a", 8)))
    request = {"aborted": _request("a", aborted=True), "aborted early": _request("a", aborted=True, computed=5),
               "prompt not computed": _request("a", outputs=0, computed=5)}[how]
    params = sched.finish(request)
    assert params == {"hidden_states_error": f"request 'a': hidden states not delivered: {said}"}
    assert sched.take_failures() == 1  # the worker never hears of it: the scheduler counts it
    assert sched.build_plan(_so()) == DeliveryPlan(dropped=("a",), told=("a",))
    assert not sched.build_plan(_so())  # sent once


def test_a_request_never_scheduled_gets_nothing(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    assert sched.finish(_request("never")) is None
    assert not sched.build_plan(_so())
    assert sched.take_failures() == 0  # it asked for nothing: no failure


def test_an_include_output_tokens_request_is_told_its_path_and_written_next_step(tmp_path: Path, caplog) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    (target,) = sched.build_plan(_so(_new("a", 8, include_output_tokens=True))).targets
    request = _request("a", prompt=8, outputs=3)
    assert sched.finish(request) == {"hidden_states_path": target.path, "hidden_states_num_tokens": 10}
    plan = sched.build_plan(_so())
    assert plan.finished == (("a", tuple(request.all_token_ids[:-1])),) and not plan.dropped
    with caplog.at_level(logging.ERROR, logger="omni_cache.integration.delivery_sched"):
        sched.absorb((DeliveryResult("a", None, "request 'a': hidden states not delivered: disk full"),))
    assert "disk full" in caplog.text  # the output went out already: the operator hears of it


def test_every_ended_prompt_only_request_is_told_once(tmp_path: Path) -> None:
    """The worker holds a prompt-only file from retention until its request's output (which names it)
    is out: the next plan tells it, once, for every prompt-only request that ended; an
    include_output_tokens request (its file written after the output) is never told."""
    sched = DeliveryScheduler(_settings(tmp_path))
    sched.build_plan(_so(_new("a", 8), _new("b", 8, include_output_tokens=True)))
    sched.absorb((DeliveryResult("a", "/x/a.safetensors", None, 8),))
    assert "hidden_states_path" in sched.finish(_request("a", prompt=8, outputs=3))
    sched.finish(_request("b", prompt=8, outputs=3))
    plan = sched.build_plan(_so())
    assert plan.told == ("a",) and [r for r, _ in plan.finished] == ["b"]
    assert not sched.build_plan(_so()).told


def test_an_aborted_include_output_tokens_request_is_dropped(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path))
    sched.build_plan(_so(_new("a", 8, include_output_tokens=True)))
    assert "hidden_states_error" in sched.finish(_request("a", aborted=True))
    assert sched.build_plan(_so()) == DeliveryPlan(dropped=("a",))


def test_a_refused_target_reaches_its_request_as_the_workers_error(tmp_path: Path) -> None:
    sched = DeliveryScheduler(_settings(tmp_path, allow_custom_save_path=True))
    (target,) = sched.build_plan(_so(_new("a", hidden_states_path="/etc/x.safetensors"))).targets
    sched.absorb((DeliveryResult("a", None, f"request 'a': hidden states not delivered: {target.error}"),))
    params = sched.finish(_request("a"))
    assert list(params) == ["hidden_states_error"] and "outside the delivery directory" in params["hidden_states_error"]
    assert sched.take_failures() == 0  # the worker counted it when it refused the target


def test_a_refused_target_aborted_before_its_outcome_is_counted_once_by_the_worker(tmp_path: Path) -> None:
    """The worker counts a target it refuses (a path outside the directory); the request aborted before
    that outcome reached the scheduler is not counted again there."""
    sched = DeliveryScheduler(_settings(tmp_path, allow_custom_save_path=True))
    sched.build_plan(_so(_new("a", 8, hidden_states_path="/etc/x.safetensors")))
    assert "hidden_states_error" in sched.finish(_request("a", aborted=True, computed=5))
    assert sched.take_failures() == 0
    sched.build_plan(_so(_new("b", 8)))
    assert "hidden_states_error" in sched.finish(_request("b", aborted=True, computed=5))
    assert sched.take_failures() == 1  # an ordinary target: only the scheduler knows


# ------------------------------------------------------------------------------------ settings
BAD_VALUES = [
    ("delivery_dir", 5), ("delivery_dir", ""), ("delivery_dir", "a\0b"), ("delivery_dir", ["/tmp"]),
    ("include_output_tokens", 1), ("include_output_tokens", "true"), ("allow_custom_save_path", None),
    ("delivery_max_bytes", True), ("delivery_max_bytes", 0), ("delivery_max_bytes", -5), ("delivery_max_bytes", 1.5),
    ("delivery_max_bytes", "1024"), ("delivery_max_bytes", math.nan), ("delivery_max_bytes", math.inf),
    ("delivery_max_bytes", 10**400), ("delivery_max_age_s", False), ("delivery_max_age_s", -math.inf), ("delivery_max_age_s", math.inf),
    ("delivery_timeout_s", 0.0), ("delivery_timeout_s", math.nan), ("delivery_timeout_s", 10**400),
    ("delivery_timeout_s", 1e10),  # past threading.TIMEOUT_MAX: no wait could be bounded by it
    ("delivery_max_pending", 0), ("delivery_max_pending", 2.5), ("delivery_max_pending", math.inf),
]


@pytest.mark.parametrize(("key", "value"), [pytest.param(k, v, id=f"{k}={v!r:.12}") for k, v in BAD_VALUES])
def test_a_bad_delivery_value_is_refused_naming_its_key(tmp_path: Path, key: str, value: Any) -> None:
    settings = {"delivery_dir": str(tmp_path), key: value}
    with pytest.raises(ValueError, match=re.escape(f"omni_cache.{key} must be")) as info:
        DeliverySettings.from_settings(settings)
    assert len(str(info.value).splitlines()) == 1


@given(st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=3), st.none()))
def test_a_positive_setting_is_accepted_exactly_when_it_is_a_positive_finite_number(value: Any) -> None:
    settings = {"delivery_dir": "/tmp/x", "delivery_timeout_s": value, "delivery_max_pending": value}
    good_timeout = (isinstance(value, int | float) and not isinstance(value, bool) and value > 0
                    and math.isfinite(value) and value <= threading.TIMEOUT_MAX)
    good = good_timeout and float(value).is_integer()
    if good:
        parsed = DeliverySettings.from_settings(settings)
        assert parsed.delivery_timeout_s == float(value) and parsed.delivery_max_pending == int(value)
    else:
        with pytest.raises(ValueError, match=r"omni_cache\.delivery_"):
            DeliverySettings.from_settings(settings)


@pytest.mark.parametrize("key", ["include_output_tokens", "allow_custom_save_path", "delivery_max_bytes",
                                 "delivery_max_age_s", "delivery_timeout_s", "delivery_max_pending"])
def test_a_delivery_key_without_a_delivery_dir_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"omni_cache.{key} needs omni_cache.delivery_dir")):
        DeliverySettings.from_settings({key: 1})
    with pytest.raises(ValueError, match=re.escape(f"omni_cache.{key} needs omni_cache.delivery_dir")):
        DeliverySettings.from_settings({key: 1, "delivery_dir": None})


def test_good_settings_are_read_and_the_directory_resolved(tmp_path: Path) -> None:
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
    parsed = DeliverySettings.from_settings({
        "delivery_dir": str(tmp_path.parent / f"{tmp_path.name}-link"), "include_output_tokens": True,
        "allow_custom_save_path": True, "delivery_max_bytes": 2048.0, "delivery_max_age_s": 5,
        "delivery_timeout_s": 0.5, "delivery_max_pending": 3})
    assert parsed.delivery_dir == os.path.realpath(tmp_path)
    assert (parsed.include_output_tokens, parsed.allow_custom_save_path) == (True, True)
    assert (parsed.delivery_max_bytes, parsed.delivery_max_age_s, parsed.delivery_timeout_s,
            parsed.delivery_max_pending) == (2048, 5.0, 0.5, 3)
    assert type(parsed.delivery_max_bytes) is int and type(parsed.delivery_max_age_s) is float
    assert DeliverySettings.from_settings({}) is None and DeliverySettings.from_settings({"tier_bytes": 5}) is None
    assert parsed.paths().allow_custom_path and parsed.nonce != DeliverySettings(delivery_dir="/x").nonce


def test_tier_settings_accept_delivery_without_a_wrapped_connector(tmp_path: Path) -> None:
    settings = tier_settings({"omni_cache": {"delivery_dir": str(tmp_path)}})
    assert settings["delivery"].delivery_dir == os.path.realpath(tmp_path) and settings["tier_dir"] is None
    assert tier_settings({"connectors": [{"kv_connector": "X"}]})["delivery"] is None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="must list the KV connector"):
        tier_settings({"omni_cache": {"tier_bytes": 5}})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="unknown kv_connector_extra_config"):
        tier_settings({"omni_cache": {"delivery_dir": str(tmp_path), "delivery_dirr": 1}})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"omni_cache\.delivery_timeout_s must be"):
        tier_settings({"omni_cache": {"delivery_dir": str(tmp_path), "delivery_timeout_s": -1}})
    a_file = tmp_path / "afile"
    a_file.write_text("")  # a path that exists and is no directory: refused at start, not when a worker makes it
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"omni_cache\.delivery_dir '.*afile' is an existing file"):
        tier_settings({"omni_cache": {"delivery_dir": str(a_file)}})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\['tier_dir'\] '.*afile' is an existing file"):
        tier_settings({"omni_cache": {"tier_dir": str(a_file), "delivery_dir": str(tmp_path)}})
    # below a file: no directory can be made there (before: a bare NotADirectoryError when the worker started)
    for key in ("tier_dir", "delivery_dir"):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"{key}\W+'.*afile/sub' cannot be created: '.*afile' is a "
                                                              "file, not a directory"):
            tier_settings({"omni_cache": {"delivery_dir": str(tmp_path), key: str(a_file / "sub")}})
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere: the /proc checks below still apply
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"delivery_dir '.*locked' is a directory no file can "
                                                              r"be written in \(Permission denied\)"):
            tier_settings({"omni_cache": {"delivery_dir": str(locked)}})
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"tier_dir'\] '.*locked/deep/er' cannot be created in "
                                                              r"'.*locked' \(Permission denied\)"):
            tier_settings({"omni_cache": {"delivery_dir": str(tmp_path), "tier_dir": str(locked / "deep" / "er")}})
    if os.path.isdir("/proc/self"):  # procfs takes no new entry, not even from root (os.access says yes to root)
        for key in ("tier_dir", "delivery_dir"):
            with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"{key}\W+'/proc/omni-cache-x' cannot be created "
                                                                  r"in '/proc' \("):
                tier_settings({"omni_cache": {"delivery_dir": str(tmp_path), key: "/proc/omni-cache-x"}})
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"delivery_dir '/proc/self' is a directory no file"):
            tier_settings({"omni_cache": {"delivery_dir": "/proc/self"}})
    assert tier_settings({"omni_cache": {"delivery_dir": str(tmp_path / "new" / "deep"),
                                         "tier_dir": str(tmp_path / "t")}})["tier_dir"] == str(tmp_path / "t")
    assert not [name for name in os.listdir(tmp_path) if "probe" in name]  # each tried directory is left as it was


def test_delivery_beside_a_wrapped_hidden_states_connector_is_refused_at_start(tmp_path: Path) -> None:
    """vLLM's ``ExampleHiddenStatesConnector`` answers every finished request with its own
    ``hidden_states_path``, as delivery does: the two cannot share a request's parameters, so the
    pair is refused when the connector is built (at any depth of nesting), never at the first finish."""
    ours = {"delivery_dir": str(tmp_path)}
    hidden = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_both"}
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"the wrapped ExampleHiddenStatesConnector "
                                                          r"\(kv_connector_extra_config\['connectors'\]\[1\]\)"):
        tier_settings({"omni_cache": ours, "connectors": [{"kv_connector": "ExampleConnector"}, hidden]})
    nested = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [hidden]}}
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"\['connectors'\]\[0\]\['kv_connector_extra_config'\]"
                                                          r"\['connectors'\]\[0\]\) both deliver"):
        tier_settings({"omni_cache": ours, "connectors": [nested]})
    assert tier_settings({"connectors": [hidden]})["delivery"] is None  # without delivery: theirs alone, fine
