"""The run's summary: one JSON-ready dict, rendered as a rich table or as JSON.

Owns: ``summarize`` (``SimResult`` -> dict) and ``render`` (the table and, on
failure, the mismatch report naming step, request, key and position). The
table and ``--json`` carry the same numbers.

Upholds nothing (a report); it reports the staging waits behind I2 (claim
waits from ``manager.stats()``, the builder's lag) and every I1-I10 finding.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from omni_cache.harness.sim_engine.engine import SimResult
from omni_cache.harness.sim_engine.truth import TruthSpec

MAX_REPORTED = 20


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 3)


def summarize(res: SimResult) -> dict[str, Any]:
    cfg = res.config
    spec: TruthSpec = cfg.truth_spec()
    ms = res.manager_stats
    staging = ms.get("staging") or {}
    alloc, sched = res.allocator, res.scheduler
    written = {k: res.computed_tokens * spec.row_bytes(k) for k in spec.per_token_keys}
    return {
        "ok": res.ok,
        "complete": res.complete,
        "incomplete_reasons": res.incomplete_reasons(),
        "preset": cfg.preset,
        "seed": cfg.seed,
        "mode": "eager" if cfg.eager else "async",
        "publish": cfg.publish,
        "config": cfg.as_dict(),
        "requests": {
            "asked": res.requests_asked,
            "created": res.requests_created,
            "dropped_too_long": res.requests_dropped_too_long,
            "skipped_after_abort": res.requests_skipped_after_abort,
            "not_reached": res.requests_not_reached,
            "finished": sched.finished,
            "aborted": sched.aborted,
            "preemptions": sched.preemptions,
            "resumes": sched.resumes,
            "verified_by_talker": res.talker_completed,
        },
        "steps": {"run": res.steps, "saved": res.saves, "padded": res.padded_steps,
                  "stopped_by_steps_limit": res.stopped_by_steps_limit},
        "tokens": {"computed": res.computed_tokens, "prefill": sched.prefill_tokens,
                   "decode": sched.decode_tokens, "chunked_prefills": sched.chunked_prefills},
        "prefix_cache": {
            "hit_rate": round(alloc.hits / alloc.queries, 4) if alloc.queries else 0.0,
            "hit_tokens": alloc.hits,
            "query_tokens": alloc.queries,
            "evicted_blocks": alloc.evictions,
            "same_step_hits": sched.same_step_hits,
        },
        "served_from_cache_tokens": res.rows_from_cache,
        "rows_verified": res.rows_checked,
        "staging": {
            "builder_lag_ms_p50": _ms(res.builder_lag_s, 50),
            "builder_lag_ms_p99": _ms(res.builder_lag_s, 99),
            "claims": staging.get("claims", 0),
            "claim_waits": staging.get("claim_waits", 0),
            "claim_wait_ms_p50": round(float(ms.get("staging_wait_s_p50", 0.0)) * 1e3, 3),
            "claim_wait_ms_p99": round(float(ms.get("staging_wait_s_p99", 0.0)) * 1e3, 3),
            "save_ms_p50": _ms(res.save_s, 50),
            "save_ms_p99": _ms(res.save_s, 99),
            "materialize_ms_p50": _ms(res.materialize_s, 50),
            "materialize_ms_p99": _ms(res.materialize_s, 99),
            "budget_flushes": ms.get("budget_flushes", 0),
        },
        "bytes_cached": {"pool": dict(ms.get("pool_bytes", {})), "written": written},
        "wall_s": round(res.wall_s, 3),
        "tokens_per_s": round(res.computed_tokens / res.wall_s, 1) if res.wall_s > 0 else 0.0,
        "num_mismatches": len(res.mismatches),
        "mismatches": [m.as_dict() for m in res.mismatches[:MAX_REPORTED]],
    }


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _not_run(r: dict[str, Any]) -> str:
    parts = [f"{r[k]} {what}" for k, what in (("dropped_too_long", "dropped (too long)"),
                                              ("skipped_after_abort", "later turns skipped after an abort"),
                                              ("not_reached", "not reached (steps limit)")) if r[k]]
    return f"; {', '.join(parts)}" if parts else ""


def result_line(s: dict[str, Any]) -> str:
    """The verdict in one plain line: OK / INCOMPLETE / FAILED with requests asked vs verified."""
    r = s["requests"]
    counts = (f"{r['asked']} requests asked, {r['created']} run, {r['verified_by_talker']} finished and verified "
              f"whole, {r['aborted']} aborted by the workload" + _not_run(r))
    if not s["ok"]:
        return f"FAILED: {s['num_mismatches']} mismatch(es) ({counts})"
    return f"{'OK' if s['complete'] else 'INCOMPLETE'}: {counts}"


def _result(s: dict[str, Any]) -> str:
    if not s["ok"]:
        return f"[red]FAILED: {s['num_mismatches']} mismatch(es)[/]"
    return "[green]OK[/]" if s["complete"] else "[yellow]INCOMPLETE (see below)[/]"


def render(summary: dict[str, Any], console: Console) -> None:
    """The summary table, then the mismatch report if the run failed."""
    s = summary
    title = f"omni-cache simulate: preset {s['preset']}, seed {s['seed']}, {s['mode']}, publish at {s['publish']}"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    r, st, tk, pc, sg = s["requests"], s["steps"], s["tokens"], s["prefix_cache"], s["staging"]
    rows = [
        ("requests asked / run", f"{r['asked']} / {r['created']}: {r['finished']} finished, {r['aborted']} aborted"
         + _not_run(r)),
        ("preempted / resumed", f"{r['preemptions']} / {r['resumes']}"),
        ("verified at finish (talker)", f"{r['verified_by_talker']} requests"),
        ("steps", f"{st['run']} ({st['saved']} saved, {st['padded']} padded)"
         + (" [yellow]steps limit[/]" if st["stopped_by_steps_limit"] else "")),
        ("tokens computed", f"{tk['computed']} ({tk['prefill']} prefill, {tk['decode']} decode)"),
        ("prefix hit rate", f"{pc['hit_rate']:.1%} ({pc['hit_tokens']} / {pc['query_tokens']})"),
        ("tokens served from the cache", str(s["served_from_cache_tokens"])),
        ("rows verified (all keys)", str(s["rows_verified"])),
        ("builder lag p50 / p99", f"{sg['builder_lag_ms_p50']:.2f} / {sg['builder_lag_ms_p99']:.2f} ms"),
        ("staging claim waits", f"{sg['claim_waits']} of {sg['claims']} saves"),
        ("claim wait p50 / p99", f"{sg['claim_wait_ms_p50']:.2f} / {sg['claim_wait_ms_p99']:.2f} ms"),
        ("save / materialize p50", f"{sg['save_ms_p50']:.2f} / {sg['materialize_ms_p50']:.2f} ms"),
        ("GPU-budget flushes", str(sg["budget_flushes"])),
    ]
    pool, written = s["bytes_cached"]["pool"], s["bytes_cached"]["written"]
    for key in sorted(set(pool) | set(written)):
        rows.append((f"bytes cached: {key}", f"{_bytes(written.get(key, 0))} written (pool {_bytes(pool.get(key, 0))})"))
    rows += [
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("tokens/s (end to end, verified)", f"{s['tokens_per_s']:,.0f}"),
        ("result", _result(s)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"result: {result_line(s)}", markup=False, highlight=False, soft_wrap=True)
    if not s["ok"]:
        console.print("[red bold]Mismatches and contract errors (first of each run):[/]")
        for m in s["mismatches"]:
            parts = [f"step {m['step']}" + (f" (step id {m['step_id']})" if m["step_id"] is not None else "")]
            if m["request"] is not None:
                parts.append(f"request {m['request']}")
            if m["key"] is not None:
                parts.append(f"key {m['key']!r}")
            if m["position"] is not None:
                parts.append(f"position {m['position']}")
            console.print(f"  {', '.join(parts)}: {m['detail']}", markup=False, highlight=False)
        if s["num_mismatches"] > len(s["mismatches"]):
            console.print(f"  ... {s['num_mismatches'] - len(s['mismatches'])} more", markup=False)
