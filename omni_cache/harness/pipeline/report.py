"""The summary of an ``omni-cache pipeline`` run: one JSON-ready dict, a table or JSON.

Owns: ``summarize`` (``PipelineResult`` -> dict: ``ok``, ``requests``,
``hit_tokens``, ``talker_identical``, ``controls_caught`` (of
``controls_run``), ``prefill_tokens_with_apc`` / ``_without_apc``,
``thinker_speedup``, ``end_to_end_speedup``, ``apc_alone_speedup`` (prefix caching
without the cache: the upper bound), the speed ``targets``, ``vllm_version``, the thinker's
``model``, ``kv_groups``, ``tp``, ``pp`` and worker ``ranks``, with ``--kv-connector``
``tier_hit_tokens``, ``tier_bytes``, ``tier_load_failures`` and the ``tier`` counters (place, host bytes), with
``--speculative`` ``speculative`` and ``draft_tokens_accepted`` / ``_rejected``, the cache's
cost per step and the details of every check), ``exit_code`` and ``render``.
Upholds nothing (a report).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from omni_cache.harness.exit_codes import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK
from omni_cache.harness.pipeline.checks import Verdict
from omni_cache.harness.pipeline.run import PipelineResult, RunStats

__all__ = ["exit_code", "render", "summarize"]

MAX_REPORTED = 20


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _verdict(v: Verdict) -> dict[str, Any]:
    return {"compared": v.compared, "identical": v.identical, "differing": v.differing,
            "tokens_differ": v.tokens_differ, "max_logprob_diff": v.max_logprob_diff,
            "min_logprob_diff": v.min_logprob_diff,
            "differences": [f"{c.name}: {c.detail}" for c in v.comparisons if not c.identical][:MAX_REPORTED]}


def _run(s: RunStats) -> dict[str, Any]:
    t = s.timers
    return {"finished": s.finished, "talker_finished": s.talker_finished, "pipeline_steps": s.pipeline_steps,
            "steps_both_engines": s.overlap_steps, "thinker_steps": t.steps, "prefill_tokens": s.prefill_tokens,
            "hit_tokens": s.hit_tokens, "hit_requests": s.hit_requests, "thinker_s": round(s.thinker_s, 4),
            "talker_s": round(s.talker_s, 4), "end_to_end_s": round(s.end_to_end_s, 4),
            "forward_s": round(t.forward_s, 4), "checker_s_excluded": round(t.checker_s, 4)}


def exit_code(res: PipelineResult) -> int:
    if res.failed:
        return EXIT_FAILED
    return EXIT_INCOMPLETE if res.incomplete else EXIT_OK


def summarize(res: PipelineResult) -> dict[str, Any]:
    cfg, apc, off, alone = res.config, res.with_apc, res.without_apc, res.apc_alone
    timers = res.cache_timers or [apc.timers]
    steps = sum(t.steps for t in timers)
    per = max(steps, 1)

    def ms(attr: str) -> float:
        return round(1e3 * sum(getattr(t, attr) for t in timers) / per, 3)

    targets = res.targets()
    return {
        "ok": res.ok,
        "exit_code": exit_code(res),
        "vllm_version": res.vllm_version,
        "preset": cfg.preset,
        "seed": cfg.seed,
        "config": cfg.as_dict(),
        "requests": res.requests,
        "finished": {"with_apc": apc.finished, "without_apc": off.finished,
                     "talker_with_apc": apc.talker_finished, "talker_without_apc": off.talker_finished},
        "hit_tokens": apc.hit_tokens,
        "hit_requests": apc.hit_requests,
        "same_step_hits": res.same_step_hits,
        "served_from_cache_tokens": res.served_from_cache,
        "talker_identical": res.talker_identical,
        "identity": {**_verdict(res.identity), "tolerance": cfg.tolerance},
        "thinker_answers_identical": res.thinker_answers_equal,
        "prompt_rows_max_rel_diff": res.row_max_rel_diff,
        "controls_caught": res.controls_caught,
        "controls_run": 2,
        "controls": {"computed_rows_only": {**_verdict(res.control_computed),
                                            "caught": res.control_computed.all_differ},
                     "perturbed_row": {**_verdict(res.control_perturbed), "caught": res.control_perturbed.all_differ,
                                       "row": res.perturbed}},
        "model": cfg.model,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "ranks": res.ranks,
        "kv_groups": res.kv_groups,
        "kv_connector": cfg.kv_connector,
        "tier": res.tier,
        "tier_hit_tokens": res.tier.get("tier_hit_tokens", 0),
        "tier_bytes": res.tier.get("tier_bytes", 0),
        "tier_load_failures": res.tier.get("tier_load_failures", 0),
        "speculative": res.speculative or None,
        "draft_tokens_accepted": res.speculative.get("draft_tokens_accepted", 0),
        "draft_tokens_rejected": res.speculative.get("draft_tokens_rejected", 0),
        "rows_verified": res.rows_verified,
        "second_materialize_refused": res.double_materialize_refused,
        "prefill_tokens_with_apc": apc.prefill_tokens,
        "prefill_tokens_without_apc": off.prefill_tokens,
        "prefill_saving": round(1 - apc.prefill_tokens / off.prefill_tokens, 4) if off.prefill_tokens else None,
        "thinker_s_with_apc": round(apc.thinker_s, 4),
        "thinker_s_without_apc": round(off.thinker_s, 4),
        "thinker_speedup": _ratio(off.thinker_s, apc.thinker_s),
        "end_to_end_s_with_apc": round(apc.end_to_end_s, 4),
        "end_to_end_s_without_apc": round(off.end_to_end_s, 4),
        "end_to_end_speedup": _ratio(off.end_to_end_s, apc.end_to_end_s),
        "thinker_cpu_s_with_apc": round(apc.thinker_cpu_s, 4),
        "thinker_cpu_s_without_apc": round(off.thinker_cpu_s, 4),
        "thinker_cpu_speedup": _ratio(off.thinker_cpu_s, apc.thinker_cpu_s),
        "end_to_end_cpu_s_with_apc": round(apc.end_to_end_cpu_s, 4),
        "end_to_end_cpu_s_without_apc": round(off.end_to_end_cpu_s, 4),
        "end_to_end_cpu_speedup": _ratio(off.end_to_end_cpu_s, apc.end_to_end_cpu_s),
        "thinker_s_apc_alone": round(alone.thinker_s, 4) if alone is not None else None,
        "apc_alone_speedup": _round(res.speedup(alone)),
        "end_to_end_s_apc_alone": round(alone.end_to_end_s, 4) if alone is not None else None,
        "apc_alone_end_to_end_speedup": _round(res.speedup(alone, "end_to_end_s")),
        "prefill_tokens_apc_alone": alone.prefill_tokens if alone is not None else None,
        "cache_cost": {"steps": steps, "repeats": len(timers), "forward_ms_per_step": ms("forward_s"),
                       "begin_step_ms_per_step": ms("begin_s"), "save_ms_per_step": ms("save_s"),
                       "materialize_ms_per_step": ms("materialize_s"),
                       "fraction_of_forward": _round(res.cache_fraction_of_forward(), 4)},
        "targets": {**targets, "kept_of_apc_alone": _round(targets["kept_of_apc_alone"]),
                    "fraction_of_forward": _round(targets["fraction_of_forward"], 4)},
        "runs": {"with_apc": _run(apc), "without_apc": _run(off),
                 "apc_alone": _run(alone) if alone is not None else None},
        "repeats": {"with_apc": res.repeats_with_apc, "without_apc": res.repeats_without_apc,
                    "apc_alone": res.repeats_apc_alone},
        "engine_start_s": round(res.engine_start_s, 3),
        "wall_s": round(res.wall_s, 3),
        "num_mismatches": len(res.mismatches),
        "mismatches": [str(m) for m in res.mismatches[:MAX_REPORTED]],
    }


def _targets(t: dict[str, Any]) -> str:
    line = (f"thinker_speedup / apc_alone_speedup {t['kept_of_apc_alone']} (>= {t['kept_min']}), cache "
            f"{t['fraction_of_forward']} of the forward (<= {t['fraction_max']})")
    if not t["judged"]:
        return line + ": reported, not judged (judged for --model wide)"
    return line + (": [green]met[/]" if t["met"] else ": [yellow]MISSED[/]")


def _check(v: dict[str, Any], what: str) -> str:
    return (f"{v['identical']}/{v['compared']} identical, {v['tokens_differ']} with other tokens, "
            f"max |logprob diff| {v['max_logprob_diff']:.3g}{what}")


def _control(v: dict[str, Any], what: str, caught: dict[bool, str]) -> str:
    if not v["compared"]:
        return "not run: no request hit the prefix cache"
    return f"{caught[v['caught']]}: " + _check(v, what)


def render(s: dict[str, Any], console: Console) -> None:
    title = f"omni-cache pipeline (vLLM {s['vllm_version']}): preset {s['preset']}, seed {s['seed']}"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("check / measurement")
    table.add_column("value", justify="right")
    idt, c1, c2, cc = s["identity"], s["controls"]["computed_rows_only"], s["controls"]["perturbed_row"], s["cache_cost"]
    f = s["finished"]
    caught = {True: "[green]caught[/]", False: "[red]NOT caught[/]"}
    rows = [
        ("requests (thinker / talker, APC on | off)", f"{s['requests']}: {f['with_apc']} / {f['talker_with_apc']} | "
         f"{f['without_apc']} / {f['talker_without_apc']}"),
        ("prefix hits (engine)", f"{s['hit_tokens']} tokens in {s['hit_requests']} requests "
         f"({s['same_step_hits']} within a step)"),
        ("rows served from the cache / verified bit for bit", f"{s['served_from_cache_tokens']} / {s['rows_verified']}"),
        ("thinker answers identical to APC off", f"{s['thinker_answers_identical']}/{s['requests']}"),
        ("full-prompt rows vs APC off (max rel diff)", f"{s['prompt_rows_max_rel_diff']:.3g}"),
        ("talker output vs APC off", _check(idt, f" (tolerance {idt['tolerance']:g})")),
        ("control (i): only the computed rows", _control(c1, "", caught)),
        ("control (ii): one prefix row perturbed", _control(c2, f" ({c2['row']})", caught)),
        ("thinker prefill tokens, APC on / off", f"{s['prefill_tokens_with_apc']} / {s['prefill_tokens_without_apc']}"
         + (f" ({100 * s['prefill_saving']:.0f}% saved)" if s["prefill_saving"] is not None else "")),
        ("thinker time, APC on / off", f"{s['thinker_s_with_apc']:.3f} s / {s['thinker_s_without_apc']:.3f} s "
         f"(x{s['thinker_speedup']})"),
        ("end-to-end time, APC on / off", f"{s['end_to_end_s_with_apc']:.3f} s / {s['end_to_end_s_without_apc']:.3f} s "
         f"(x{s['end_to_end_speedup']})"),
        ("thinker CPU time, APC on / off", f"{s['thinker_cpu_s_with_apc']:.3f} s / "
         f"{s['thinker_cpu_s_without_apc']:.3f} s (x{s['thinker_cpu_speedup']})"),
        ("end-to-end CPU time, APC on / off", f"{s['end_to_end_cpu_s_with_apc']:.3f} s / "
         f"{s['end_to_end_cpu_s_without_apc']:.3f} s (x{s['end_to_end_cpu_speedup']})"),
        ("thinker time, APC without the cache (upper bound)", "not run (--tp/--pp or --kv-connector)"
         if s["thinker_s_apc_alone"] is None else f"{s['thinker_s_apc_alone']:.3f} s (x{s['apc_alone_speedup']} over "
         f"APC off; end to end x{s['apc_alone_end_to_end_speedup']}; its talker got wrong rows: not a check)"),
        ("cache cost per thinker step", f"begin_step {cc['begin_step_ms_per_step']:.3f} ms + save "
         f"{cc['save_ms_per_step']:.3f} ms + materialize {cc['materialize_ms_per_step']:.3f} ms vs forward "
         f"{cc['forward_ms_per_step']:.3f} ms ({cc['fraction_of_forward']} of it, {cc['steps']} steps, "
         f"{cc['repeats']} repeats)"),
        ("speed targets", _targets(s["targets"])),
        ("thinker", f"{s['model']}, {s['kv_groups']} KV-cache group(s), tp {s['tp']} x pp {s['pp']}" + (
            "; host bytes per rank " + ", ".join(f"{r.get('rank')}: {r.get('host_bytes', 0):,}" for r in s["ranks"])
            if s["ranks"] else "")),
        *([("hidden-state tier (--kv-connector)", f"{s['tier_hit_tokens']} tier hit tokens restored of "
            f"{s['tier'].get('external_tokens', 0)} the connector loaded, {s['tier_bytes']:,} bytes held, "
            f"{s['tier_load_failures']} load failures")] if s["kv_connector"] else []),
        *([("speculative decoding (--speculative)", f"{s['speculative']['method']}: {s['draft_tokens_accepted']} "
            f"draft tokens accepted, {s['draft_tokens_rejected']} rejected (vLLM: "
            f"{s['speculative']['vllm_accepted_tokens']} of {s['speculative']['vllm_draft_tokens']}), "
            f"{s['speculative']['rows_trimmed']} rows trimmed")] if s["speculative"] else []),
        ("engine start / wall time", f"{s['engine_start_s']:.1f} s / {s['wall_s']:.1f} s"),
    ]
    if s["ok"]:
        verdict = "[green]OK[/]"
    elif s["exit_code"] == 3 and s["speculative"] and not s["draft_tokens_rejected"]:
        verdict = "[yellow]INCOMPLETE: no draft token was rejected, nothing about a verify step's trim was shown[/]"
    elif s["exit_code"] == 3 and s["hit_tokens"]:
        verdict = "[yellow]MISSED ITS SPEED TARGET: the checks passed, the time ratios did not (see above)[/]"
    elif s["exit_code"] == 3:
        verdict = "[yellow]INCOMPLETE: no request hit the prefix cache, nothing about cached rows was shown[/]"
    else:
        verdict = f"[red]FAILED[/] ({s['num_mismatches']} mismatch(es))"
    rows.append(("result", verdict))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if idt["differences"]:
        console.print("[red bold]Talker outputs that differ from prefix caching off:[/]")
        for d in idt["differences"]:
            console.print(f"  {d}", markup=False, highlight=False, soft_wrap=True)
    if s["mismatches"]:
        console.print("[red bold]Mismatches and contract errors:[/]")
        for m in s["mismatches"]:
            console.print(f"  {m}", markup=False, highlight=False, soft_wrap=True)
