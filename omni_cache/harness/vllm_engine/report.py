"""The summary of a ``--engine vllm`` run: one JSON-ready dict, a table or JSON.

Owns: ``summarize`` (``VllmSimResult`` -> dict, the keys of the simulated
engine's summary where they mean the same, plus ``engine``, ``vllm_version``,
``hit_tokens``, ``preemptions``, ``rows_verified``, ``model``, ``kv_groups``,
``output_group_id``, the three checks, the worker ``ranks`` with their host
bytes and what the run did less than asked, ``incomplete``) and ``render``.
Upholds nothing (a report).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from omni_cache.harness.vllm_engine.engine import VllmSimResult

MAX_REPORTED = 20


def summarize(res: VllmSimResult) -> dict[str, Any]:
    cfg = res.config
    return {
        "ok": res.ok and not res.incomplete,
        "engine": "vllm",
        "vllm_version": res.vllm_version,
        "preset": cfg.preset,
        "model": cfg.model,
        "kv_groups": res.kv_groups,
        "output_group_id": res.output_group_id,
        "seed": cfg.seed,
        "mode": "eager" if cfg.eager else "async",
        "config": cfg.as_dict(),
        "requests": {"created": res.requests_created, "finished": res.finished, "aborted": res.aborted,
                     "preemptions": res.preemptions},
        "steps": {"run": res.steps, "saved": res.saved},
        "tokens": {"computed": res.computed_tokens, "chunked_prefills": res.chunked_prefills},
        "prefix_cache": {"hit_tokens": res.hit_tokens, "same_step_hits": res.same_step_hits},
        "hit_tokens": res.hit_tokens,
        "preemptions": res.preemptions,
        "served_from_cache_tokens": res.served_from_cache,
        "rows_verified": res.rows_verified,
        "checks": {
            "a_bit_exact_rows": res.rows_verified,
            "b_recompute": {"requests": res.recompute_requests, "rows": res.recompute_rows,
                            "bit_identical_rows": res.recompute_exact_rows,
                            "max_abs_diff": res.recompute_max_abs_diff,
                            "max_rel_diff": res.recompute_max_rel_diff, "tolerance_rel": cfg.tolerance},
            "c_step_ids": {"published": res.published, "consumed": res.consumed,
                           "unconsumed_at_shutdown": len(res.unconsumed),
                           "second_materialize_refused": res.double_consume_refused},
        },
        "parallel": {"tp": cfg.tp, "pp": cfg.pp, "workers": cfg.tp * cfg.pp,
                     "check_ranks": cfg.check_ranks, "rank_rows_compared": res.rank_rows_compared},
        "kv_blocks": {"asked": cfg.as_dict()["kv_blocks"], "engine": res.kv_blocks_engine},
        "ranks": [dict(r) for r in res.ranks],
        "incomplete": list(res.incomplete),
        "engine_start_s": round(res.engine_start_s, 3),
        "wall_s": round(res.wall_s, 3),
        "num_mismatches": len(res.mismatches),
        "mismatches": [m.as_dict() for m in res.mismatches[:MAX_REPORTED]],
    }


def render(s: dict[str, Any], console: Console) -> None:
    title = (f"omni-cache simulate --engine vllm (vLLM {s['vllm_version']}): model {s['model']}, preset {s['preset']}, "
             f"seed {s['seed']}, {s['mode']}")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    r, st, tk, pc, ck = s["requests"], s["steps"], s["tokens"], s["prefix_cache"], s["checks"]
    b, c = ck["b_recompute"], ck["c_step_ids"]
    rows = [
        ("requests", f"{r['created']}: {r['finished']} finished, {r['aborted']} aborted"),
        ("preemptions", str(r["preemptions"])),
        ("KV-cache groups (rows addressed by)", f"{s['kv_groups']} (group {s['output_group_id']})"),
        ("engine steps", f"{st['run']} ({st['saved']} saved)"),
        ("tokens computed", f"{tk['computed']} ({tk['chunked_prefills']} chunked-prefill continuations)"),
        ("prefix hit tokens (engine)", f"{pc['hit_tokens']} ({pc['same_step_hits']} same-step hits)"),
        ("rows served from the cache", str(s["served_from_cache_tokens"])),
        ("(a) rows verified bit for bit (all keys)", str(s["rows_verified"])),
        ("(b) prompts vs recomputation", f"{b['requests']} prompts, {b['rows']} rows, max |diff| "
         f"{b['max_abs_diff']:.3g} ({b['max_rel_diff']:.3g} of the row's max, tolerance {b['tolerance_rel']:g}), "
         f"{b['bit_identical_rows']} bit-identical"),
        ("(c) step ids consumed once", f"{c['consumed']} of {c['published']}, {c['unconsumed_at_shutdown']} "
         f"left, second materialize {'refused' if c['second_materialize_refused'] else 'NOT refused'}"),
        ("KV blocks (asked / engine)", f"{s['kv_blocks']['asked']} / {s['kv_blocks']['engine']}"),
        *[(f"rank {r.get('rank', i)} (tp {r.get('tp_rank')}, pp {r.get('pp_rank')})",
           f"{r['host_bytes']:,} host bytes{' (output rank)' if r.get('output_rank') else ''}")
          for i, r in enumerate(s["ranks"])],
        *([("(ranks) rows equal on every TP rank", str(s["parallel"]["rank_rows_compared"]))]
          if s["parallel"]["check_ranks"] else []),
        ("engine start / wall time", f"{s['engine_start_s']:.1f} s / {s['wall_s']:.1f} s"),
        ("result", f"[red]FAILED: {s['num_mismatches']} mismatch(es)[/]" if s["num_mismatches"] else
         "[yellow]INCOMPLETE: " + escape("; ".join(s["incomplete"])) + "[/]" if s["incomplete"] else "[green]OK[/]"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if s["mismatches"]:  # an incomplete run has none to list: its reason is in the result row
        console.print("[red bold]Mismatches and contract errors:[/]")
        for m in s["mismatches"]:
            parts = [f"step {m['step']}" + (f" (step id {m['step_id']})" if m["step_id"] is not None else "")]
            for label, k in (("request", "request"), ("key", "key"), ("position", "position")):
                if m[k] is not None:
                    parts.append(f"{label} {m[k]}")
            console.print(f"  {', '.join(parts)}: {m['detail']}", markup=False, highlight=False, soft_wrap=True)
        if s["num_mismatches"] > len(s["mismatches"]):
            console.print(f"  ... {s['num_mismatches'] - len(s['mismatches'])} more", markup=False)
