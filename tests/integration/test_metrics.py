"""The numbers behind the served engine's cache metrics, without vLLM.

Protects: every observation a metrics report hands out is handed out once and the history
between reports stays bounded (``ObservationLog``, ``take_staging_waits``: one value per staging
claim, 0.0 when a slot was free, the wait when one was not); ``saved_rows`` counts every row a
successful save staged and ``writes_failed`` every write a failure failed (contract 4.7); a
contract error is filed under the kind of its outermost phrase (``error_kind``), and the errors
the bridge and the delivery contain are counted by kind; the worker's report
(``CacheMetricsReporter``) hands out counter increments that add up to the cumulative numbers,
the current gauges and the new observations -- nothing when nothing changed, and nothing at all
on a rank that is not the output rank or whose cache is off.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cache_helpers import finished, manager, save, started, wait_for_waiter

from omni_cache.integration.delivery import DeliveryPlan, DeliveryTarget, RowDelivery
from omni_cache.integration.delivery_settings import DeliverySettings
from omni_cache.integration.metrics import SERIES, CacheMetricsReporter, cache_sources
from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan
from omni_cache.integration.vllm_bridge import VllmRunnerBridge
from omni_cache.runtime.errors import (
    ALL_PHRASES,
    ERROR_KINDS,
    KIND_BY_PHRASE,
    ErrorTally,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    error_kind,
)
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.histogram import ObservationLog
from omni_cache.runtime.staging import CLAIM_WAIT_LOG
from omni_cache.runtime.tier import HiddenTier

# ---- observations: each handed out once, bounded in between -------------------------------


def test_an_observation_log_hands_each_value_out_once_and_drops_the_oldest_beyond_its_capacity() -> None:
    log = ObservationLog(capacity=3)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        log.record(value)
    assert len(log) == 3 == log.capacity and log.dropped(5) == 2
    assert log.take() == (3.0, 4.0, 5.0)
    assert log.take() == () and len(log) == 0
    log.record(6.0)
    assert log.dropped(6) == 2
    assert log.take() == (6.0,) and log.dropped(6) == 2
    with pytest.raises(ValueError, match="capacity"):
        ObservationLog(capacity=0)


def test_every_staging_claim_is_one_observation_zero_when_a_slot_was_free() -> None:
    m = manager()
    try:
        m.new_step_starts([started("A")])
        for start in (0, 4, 8):
            step, _ = save(m, [("A", [0, 1, 2], start, start + 4)])
            m.discard_step(step)
        waits = m.take_staging_waits()
        assert waits == (0.0, 0.0, 0.0) and m.stats()["staging"]["claims"] == 3
        assert m.take_staging_waits() == (), "an observation was handed out twice"
    finally:
        m.shutdown()


def test_a_save_that_waited_for_a_slot_hands_out_its_wait() -> None:
    m = manager(staging_depth=1)
    try:
        m.new_step_starts([started("A"), started("B")])
        first, _ = save(m, [("A", [0], 0, 4)])
        done: list[int] = []
        waiter = threading.Thread(target=lambda: done.append(save(m, [("B", [1], 0, 4)])[0]))
        waiter.start()
        wait_for_waiter(m.staging, "the second save waits for the only staging slot")
        m.discard_step(first)
        waiter.join(10)
        assert done, "the waiting save never got its slot"
        m.discard_step(done[0])
        waits = m.take_staging_waits()
        stats = m.stats()
        assert len(waits) == 2 == stats["staging"]["claims"] and waits[0] == 0.0
        assert 0.0 < waits[1] <= stats["staging"]["claim_wait_s_max"] and stats["staging"]["claim_waits"] == 1
    finally:
        m.shutdown()


def test_the_wait_log_is_bounded_when_nobody_reads_it_and_says_how_many_it_dropped() -> None:
    m = manager()
    try:
        m.new_step_starts([started("A")])
        for i in range(CLAIM_WAIT_LOG + 5):
            step, _ = save(m, [("A", [i % 16], 0, 1)])
            m.discard_step(step)
        assert len(m.take_staging_waits()) == CLAIM_WAIT_LOG
        assert m.stats()["staging"]["claim_waits_dropped"] == 5
    finally:
        m.shutdown()


# ---- contract 4.7: rows saved, writes failed ---------------------------------------------------


def test_saved_rows_counts_the_rows_of_every_successful_save_only() -> None:
    m = manager()
    try:
        m.new_step_starts([started("A"), started("B")])
        s1, _ = save(m, [("A", [0, 1], 0, 3), ("B", [2], 0, 2)], padded=8)  # 5 rows, padded to 8
        s2, _ = save(m, [("A", [0, 1], 3, 5)])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="staging capacity is"):
            save(m, [("B", list(range(0, 22)), 2, 2 + 80)])  # larger than a page: refused, nothing staged
        m.discard_step(s1)
        m.discard_step(s2)
        assert m.stats()["saved_rows"] == 7 and m.stats()["saved"] == 2
    finally:
        m.shutdown()


class _FailingPoolWrite(FaultHooks):
    def before_pool_write(self, write: object, key: str) -> None:
        raise OSError("injected: the pool write failed")


def test_writes_failed_counts_each_write_a_failure_failed() -> None:
    from cache_helpers import config

    from omni_cache.runtime.manager import OmniPrefixCacheManager

    m = OmniPrefixCacheManager(config(), eager=True, faults=_FailingPoolWrite())
    try:
        assert m.stats()["writes_failed"] == 0
        m.new_step_starts([started("A")])
        with pytest.raises((OmniPrefixCacheUnmatchError, OSError)):
            step, _ = save(m, [("A", [0], 0, 4)])
            m.discard_step(step)
        stats = m.stats()
        assert stats["failed"] is not None and stats["writes_failed"] >= 1
        assert stats["writes_failed"] == m.book.num_failed
    finally:
        m.shutdown()


# ---- error kinds -----------------------------------------------------------------------------


@pytest.mark.parametrize("phrase", ALL_PHRASES)
def test_each_contract_phrase_has_its_kind(phrase: str) -> None:
    assert error_kind(OmniPrefixCacheUnmatchError(f"materialize step 3: {phrase} (I1)")) == KIND_BY_PHRASE[phrase]
    assert KIND_BY_PHRASE[phrase] in ERROR_KINDS


def test_a_chained_error_is_filed_under_its_outermost_phrase_and_a_timeout_under_staging() -> None:
    chained = ("cannot materialize: write failed: write tid 4 in save_outputs step 9: OmniPrefixCacheUnmatchError: "
               "the slot mapping covers 3 rows")
    assert error_kind(chained) == "write_failed"
    assert error_kind("save_outputs refused: the manager was shut down -- ... unconsumed step contexts: none") \
        == "shut_down"
    assert error_kind(OmniPrefixCacheStagingTimeoutError("save waited 2.000s and timed out")) == "staging"
    assert error_kind(RuntimeError("timed out after 30.000s while materialize")) == "other"
    assert len(ERROR_KINDS) == len(set(ERROR_KINDS)) <= 8


def test_an_error_tally_counts_by_kind_with_every_kind_present() -> None:
    tally = ErrorTally()
    assert tally.counts() == dict.fromkeys(ERROR_KINDS, 0)
    assert tally.record(OmniPrefixCacheUnmatchError("key 'hidden' at KV slot 3 is not readable")) == "not_readable"
    tally.record("cannot save_outputs: the manager was shut down")
    tally.record(ValueError("no phrase"))
    counts = tally.counts()
    assert counts["not_readable"] == counts["shut_down"] == counts["other"] == 1 and sum(counts.values()) == 3


class _RaisingHooks:
    """Hooks whose step start raises a contract error (the bridge must contain and count it)."""

    config = SimpleNamespace(staging_depth=4)
    manager = None

    def begin_step(self, scheduler_output: Any) -> None:
        raise OmniPrefixCacheUnmatchError("engine step: prefix hit not block aligned (block_size 16) (I5)")


def test_the_bridge_counts_each_error_it_contains_by_kind() -> None:
    bridge = VllmRunnerBridge({"consumer": "discard"}, hooks=_RaisingHooks())  # type: ignore[arg-type]
    bridge.consumer = "discard"
    bridge.begin_step(SimpleNamespace(total_num_scheduled_tokens=1))
    assert bridge.failed is not None and "not block aligned" in bridge.failed
    assert bridge.errors.counts()["invalid_hit"] == 1 and sum(bridge.errors.counts().values()) == 1
    queue_bridge = VllmRunnerBridge({"consumer": "queue"}, hooks=_RaisingHooks())  # type: ignore[arg-type]
    with pytest.raises(OmniPrefixCacheUnmatchError):
        queue_bridge.begin_step(SimpleNamespace(total_num_scheduled_tokens=1))
    assert sum(queue_bridge.errors.counts().values()) == 0, "a raised error is not a contained one"


class _NotSavedManager:
    """A manager that never saved the step: both consumes refuse it, as a real manager's do."""

    def materialize(self, step_id: int, req_ids: Any) -> Any:
        raise OmniPrefixCacheUnmatchError(f"materialize: step id {step_id} was already consumed or never saved (I1)")

    def discard_step(self, step_id: int) -> None:
        raise OmniPrefixCacheUnmatchError(f"discard_step: step id {step_id} was already consumed or never saved (I1)")


def test_the_delivery_counts_a_failed_materialize_by_kind_and_fails_its_request(tmp_path: Path) -> None:
    delivery = RowDelivery(DeliverySettings(str(tmp_path)))
    try:
        path = str(tmp_path / "r1.safetensors")
        delivery.begin_step(DeliveryPlan(targets=(DeliveryTarget("r1", path, None, 4, False),)), {"r1": [5, 6, 7, 8]})
        delivery.consume(_NotSavedManager(), 7, [("r1", 0, 4)])
        assert delivery.errors.counts()["step_id"] == 1 and delivery.counters["failures"] == 1
        (result,) = delivery.take_results()
        assert result.error is not None and "never saved" in result.error
    finally:
        delivery.shutdown()


# ---- the worker's report -----------------------------------------------------------------------


def _bridge(m: Any, *, config: Any = "same") -> SimpleNamespace:
    hooks = SimpleNamespace(manager=m, config=m.config if config == "same" else config)
    return SimpleNamespace(hooks=hooks, errors=ErrorTally(), failed=None, delivery=None)


def _reporter(m: Any, *, output_rank: bool = True, tier: TierApplier | None = None) -> tuple[Any, CacheMetricsReporter]:
    bridge = _bridge(m)
    reporter = CacheMetricsReporter(None, tier)
    reporter.bind(bridge, output_rank=output_rank)
    return bridge, reporter


def test_report_increments_add_up_to_the_cumulative_numbers_and_nothing_changed_is_no_report() -> None:
    m = manager()
    tier = TierApplier(HiddenTier(1 << 20), m.config.block_size)
    bridge, reporter = _reporter(m, tier=tier)
    try:
        m.new_step_starts([started("A")])
        step, _ = save(m, [("A", [0, 1], 0, 6)])
        m.discard_step(step)
        first = reporter.report()
        assert first is not None
        assert first["counters"]["saved_tokens"] == 6 and "hit_tokens" not in first["counters"]
        assert first["gauges"]["staging_depth"] == m.config.staging_depth and first["gauges"]["pool_bytes"] > 0
        assert first["observations"] == {"staging_wait_seconds": [0.0]}
        assert reporter.report() is None, "nothing changed: no report"
        m.new_step_starts([finished("A"), started("B", hit_end=4, blocks=[0])])
        step, _ = save(m, [("B", [0, 2], 4, 7)])
        m.discard_step(step)
        bridge.errors.record("materialize: key 'hidden' at KV slot 1 is not readable")
        tier.apply(TierPlan(loads=(TierLoad("C", 0, b"never-stored", 5),)), m)  # a load the tier cannot serve
        second = reporter.report()
        assert second is not None
        assert second["counters"] == {"saved_tokens": 3, "hit_tokens": 4, "hit_requests": 1, "tier_loads": 1,
                                      "tier_load_failures": 1}
        assert second["errors"] == {"not_readable": 1}
        stats = m.stats()
        total = first["counters"]["saved_tokens"] + second["counters"]["saved_tokens"]
        assert total == stats["saved_rows"] and second["counters"]["hit_tokens"] == stats["hit_tokens"]
        assert reporter.report() is None
    finally:
        m.shutdown()


def test_only_the_output_rank_of_an_engine_whose_cache_is_on_reports() -> None:
    m = manager()
    try:
        m.new_step_starts([started("A")])
        step, _ = save(m, [("A", [0], 0, 4)])
        m.discard_step(step)
        _, other_rank = _reporter(m, output_rank=False)
        assert not other_rank.reporting and other_rank.report() is None
        off = CacheMetricsReporter()
        off.bind(_bridge(m, config=None), output_rank=True)
        assert not off.reporting and off.report() is None
        assert not CacheMetricsReporter().reporting  # never bound: no runner bridge in this worker
        assert m.take_staging_waits() == (0.0,), "a rank that does not report must not take the observations"
    finally:
        m.shutdown()


class _BrokenStats:
    config = SimpleNamespace(staging_depth=4)

    def stats(self) -> dict[str, Any]:
        raise KeyError("a bug in the numbers")


def test_a_report_that_fails_ends_the_reports_and_never_raises_into_the_engine() -> None:
    broken = _BrokenStats()
    bridge = SimpleNamespace(hooks=SimpleNamespace(manager=broken, config=broken.config), errors=ErrorTally(),
                             failed=None, delivery=None)
    reporter = CacheMetricsReporter()
    reporter.bind(bridge, output_rank=True)
    assert reporter.reporting
    assert reporter.report() is None and reporter.failed is not None and "a bug in the numbers" in reporter.failed
    assert not reporter.reporting and reporter.report() is None


def test_before_the_first_step_the_report_has_the_configured_depth_and_zeros() -> None:
    m = manager()
    try:
        bridge = SimpleNamespace(hooks=SimpleNamespace(manager=None, config=m.config), errors=ErrorTally(),
                                 failed=None, delivery=None)
        reporter = CacheMetricsReporter()
        reporter.bind(bridge, output_rank=True)
        report = reporter.report()
        assert report is not None and report["counters"] == {} and report["observations"] == {}
        assert report["gauges"]["staging_depth"] == m.config.staging_depth
        assert sum(v for k, v in report["gauges"].items() if k != "staging_depth") == 0
        sources = cache_sources(bridge)
        assert sources["manager"] is None and sources["delivery"] is None and sources["tier"] is None
    finally:
        m.shutdown()


def test_every_series_has_a_unit_and_vllm_style_name() -> None:
    import re

    for series in SERIES:
        assert re.fullmatch(r"vllm:[a-z][a-z0-9_]*", series.name), series.name
        assert not series.name.endswith("_total"), "counters are declared without _total"
        assert series.kind in ("counter", "gauge", "histogram") and series.unit and series.doc.endswith(".")
        if series.unit in ("seconds", "bytes") and series.kind != "counter":
            assert series.name.endswith("_" + series.unit), series.name
        assert bool(series.buckets) == (series.kind == "histogram")


# ---- check-server's view of /metrics -------------------------------------------------------------

_VLLM_ONLY = """# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
"""
_OURS = _VLLM_ONLY + """# HELP vllm:omni_cache_hit_tokens x
# TYPE vllm:omni_cache_hit_tokens counter
vllm:omni_cache_hit_tokens_total{engine="0",model_name="m"} 64.0
vllm:omni_cache_hit_tokens_total{engine="1",model_name="m"} 32.0
vllm:omni_cache_hit_tokens_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:omni_cache_errors x
# TYPE vllm:omni_cache_errors counter
vllm:omni_cache_errors_total{engine="0",kind="staging",model_name="m"} 2.0
# HELP vllm:omni_cache_staging_wait_seconds x
# TYPE vllm:omni_cache_staging_wait_seconds histogram
vllm:omni_cache_staging_wait_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:omni_cache_staging_wait_seconds_count{engine="0",model_name="m"} 3.0
vllm:omni_cache_staging_wait_seconds_sum{engine="0",model_name="m"} 0.5
"""


@pytest.fixture
def metrics_server() -> Any:
    """A plain HTTP server whose /metrics body the test sets (``server.body``; ``None``: 404)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = self.server.body  # type: ignore[attr-defined]
            if body is None or self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.body = None  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_check_server_reads_the_caches_series_and_says_so_when_a_server_has_none(metrics_server: Any) -> None:
    from omni_cache.cli.check_server import _metrics_lines
    from omni_cache.harness.served.scrape import metrics_section, scrape_metrics, scrape_settled

    url = f"http://127.0.0.1:{metrics_server.server_address[1]}"
    missing = scrape_metrics(url)
    assert not missing.available and "HTTP 404" in (missing.note or "")
    metrics_server.body = _VLLM_ONLY
    plain = scrape_metrics(url)
    assert not plain.available and "has no vllm:omni_cache_" in (plain.note or "")
    report = SimpleNamespace(requests=1, hit_requests=0, cached_tokens=0, metrics=metrics_section(plain, plain))
    assert report.metrics == {"available": False, "url": url + "/metrics", "note": plain.note}
    assert _metrics_lines(report) == [f"cache metrics: none ({plain.note})"]
    metrics_server.body = "this is {not prometheus"
    assert "is not Prometheus text" in (scrape_metrics(url).note or "")
    metrics_server.body = _OURS
    ours = scrape_settled(url, settle_s=1.0)
    assert ours.samples == {"vllm:prefix_cache_hits_total": 64.0, "vllm:omni_cache_hit_tokens_total": 96.0,
                            'vllm:omni_cache_errors_total{kind="staging"}': 2.0,
                            "vllm:omni_cache_staging_wait_seconds_count": 3.0,
                            "vllm:omni_cache_staging_wait_seconds_sum": 0.5}
    section = metrics_section(plain, ours)
    assert not section["available"], "a run that began without the series has no change to report"
    section = metrics_section(ours, ours)
    assert section["available"] and section["change"]["vllm:omni_cache_hit_tokens_total"] == 0
    report.metrics = section
    lines = _metrics_lines(report)
    assert lines[1].split() == ["vllm:omni_cache_hit_tokens_total", "+0", "(96)", "0", "cached", "rows", "checked;",
                                "vllm:prefix_cache_hits", "+0"]
    assert any('kind="staging"} +0 (2)' in line for line in lines)
    closed = f"http://127.0.0.1:{free_port_closed()}"
    assert not scrape_metrics(closed, timeout_s=2.0).available


def free_port_closed() -> int:
    """A port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_docs_list_every_series_with_its_type_and_unit() -> None:
    """docs/metrics.md has one table row per series (name, type, unit), every error kind, and is
    linked from docs/serving.md and the README's documentation table."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = {m.group(1): (m.group(2).strip(), m.group(3).strip())
            for m in re.finditer(r"^\| `(vllm:omni_cache_\w+)` \| ([^|]+) \| ([^|]+) \|", page, re.M)}
    assert set(rows) == {s.name for s in SERIES}
    for series in SERIES:
        kind, unit = rows[series.name]
        assert kind.startswith(series.kind) and unit == series.unit, (series.name, kind, unit)
    for kind in ERROR_KINDS:
        assert f"| `{kind}` |" in page, kind
    assert "(metrics.md)" in (root / "docs" / "serving.md").read_text(encoding="utf-8")
    assert "[docs/metrics.md](docs/metrics.md)" in (root / "README.md").read_text(encoding="utf-8")
