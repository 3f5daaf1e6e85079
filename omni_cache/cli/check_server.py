"""``omni-cache check-server URL``: a running server's delivered files checked over HTTP.

Owns: the subcommand's arguments (validated before anything heavy is imported: a mistake is one
line and exit 2), its report's text (the cache's ``/metrics`` series beside what was checked) and
its exit code: 0 every request's file equals the ground truth (its prompt
recomputed with a fresh ``cache_salt``), requests hit the prefix cache and the negative control
was caught; 1 a check failed (or the server could not be driven); 3 clean, but no request hit.
The run is ``omni_cache.harness.served.check``.

Upholds nothing itself: it checks a served engine's delivered rows (I4, I6, I7) from outside.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_cache.cli.args import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, float_range, int_range, seed_int

__all__ = ["register"]


def _url(text: str) -> str:
    """An http(s) URL with a host and, if given, a port in 1..65535 (read as the HTTP client will)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"wants http://HOST:PORT, got {text!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"wants http://HOST:PORT, got {text!r}")
    if parts.path.rstrip("/").endswith("/v1") or parts.query or parts.fragment:  # the client adds /v1/...
        raise argparse.ArgumentTypeError(f"wants http://HOST:PORT (the server's root: the checker adds /v1/...; "
                                         f"a proxy's prefix may come before it), got {text!r}")
    if port == 0:
        raise argparse.ArgumentTypeError(f"wants a port from 1 to 65535, got {text!r}")
    return text


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check-server",
        help="drive a running `omni-cache serve` over HTTP and check every delivered file against the ground "
        "truth (the same prompt recomputed with cache_salt)",
        description=(
            "Send prompts that share prefixes (families of prompts, concurrently within a round and again in a "
            "second round) to a running server, read each request's hidden-state file with vLLM's "
            "load_hidden_states and check it against the same prompt recomputed by the same server with a fresh "
            "cache_salt (no prefix cache): token_ids equal, one row per token, every row equal bit for bit (or "
            "within --tolerance, for engines that are not batch-invariant). A negative control (one prefix row "
            "perturbed) must be caught. The server's /metrics is read before and after the run: the cache's "
            "vllm:omni_cache_* series are printed beside what was checked (or why there are none). Works against "
            "the built-in tiny-llama or a real model."),
        epilog="Exit codes: 0 every file checked equal, prefix hits, control caught; 1 a check failed or the "
        "server could not be driven; 2 bad arguments; 3 clean, but no request hit the prefix cache.",
    )
    parser.add_argument("url", metavar="URL", type=_url, help="the server, e.g. http://127.0.0.1:8011")
    parser.add_argument("--families", type=int_range(1, 32), default=3, help="prompt families, 1 to 32 (default 3)")
    parser.add_argument("--per-family", type=int_range(1, 32), default=3,
                        help="requests per family and round, sent concurrently, 1 to 32 (default 3)")
    parser.add_argument("--prefix-words", type=int_range(1, 4000), default=40,
                        help="words of each family's shared prefix, 1 to 4,000 (default 40)")
    parser.add_argument("--max-tokens", type=int_range(1, 256), default=4, help="tokens generated, 1 to 256 (default 4)")
    parser.add_argument("--concurrency", type=int_range(1, 64), default=6, help="requests in flight, 1 to 64 (default 6)")
    parser.add_argument("--seed", type=seed_int, default=0, help="prompt seed, 0 to 2**32 - 1 (default 0)")
    parser.add_argument("--tolerance", type=float_range(0, 1), default=0.0,
                        help="prompt rows: largest |diff| / max |row| per row still equal (default 0: bit for bit)")
    parser.add_argument("--output-tolerance", type=float_range(0, 1), default=1e-5,
                        help="output-token rows (include_output_tokens requests): the same, for rows computed in "
                        "decode steps, which vLLM's CPU kernels do not compute batch-invariantly (default 1e-5)")
    parser.add_argument("--timeout", type=float_range(0, 86_400, lo_open=True), default=120.0,
                        help="seconds per HTTP request, > 0 and <= 86,400 (default 120)")
    parser.add_argument("--keep-files", action="store_true", help="leave the checked files in place")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omni_cache.harness.served.check import CheckConfig, HttpError, ServerCheck

    config = CheckConfig(args.url, families=args.families, per_family=args.per_family, prefix_words=args.prefix_words,
                         max_tokens=args.max_tokens, concurrency=args.concurrency, seed=args.seed,
                         tolerance=args.tolerance, output_tolerance=args.output_tolerance, timeout_s=args.timeout, keep_files=args.keep_files)
    try:
        report = ServerCheck(config).run()
    except HttpError as exc:
        print(f"omni-cache check-server: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print(report)
    if not report.ok:
        return EXIT_FAILED
    return EXIT_OK if report.hit_requests > 0 else EXIT_INCOMPLETE


def _print(report: Any) -> None:
    lines = [
        f"server {report.url} ({report.model}), files read with {report.reader}",
        f"requests: {report.requests}; files checked against the cache_salt recomputation: {report.files_checked} "
        f"({report.rows_checked} rows, {report.include_output_files} with output-token rows)",
        f"prefix hits: {report.hit_requests} requests, {report.cached_tokens} rows served from the cache",
        (f"prompt rows equal to the recomputation: {'bit for bit' if report.tolerance == 0 else f'within {report.tolerance:g}'}"
         f" (largest relative difference {report.max_rel_diff:.3g}); output-token rows within "
         f"{report.output_tolerance:g} (largest {report.max_output_rel_diff:.3g})") if report.files_checked
        else "prompt rows equal to the recomputation: none compared (no file was checked)",
        f"cached rows bit for bit the rows their family computed: {report.cached_rows_matched_origin} of "
        f"{report.cached_tokens}",
        f"negative control (a perturbed prefix row): {'caught' if report.control_caught else 'NOT caught'}",
    ]
    lines += _metrics_lines(report)
    for problem in report.problems:
        lines.append(f"PROBLEM: {problem}")
    verdict = ("OK" if report.ok and report.hit_requests else "NO HITS" if report.ok else "FAILED")
    lines.append(f"{verdict} in {report.seconds:.1f} s")
    print("\n".join(lines))


def _metrics_lines(report: Any) -> list[str]:
    """The cache's series on /metrics (change during the run, total), beside what the run checked."""
    metrics = report.metrics
    if not metrics:
        return []
    if not metrics["available"]:
        return [f"cache metrics: none ({metrics['note']})"]
    change, total = metrics["change"], metrics["total"]
    beside = {
        "vllm:omni_cache_delivered_files_total":
            f"this run got {2 * report.requests} files ({report.requests} checked, {report.requests} ground truth)",
        "vllm:omni_cache_hit_requests_total": f"{report.hit_requests} checked responses name cached rows",
        "vllm:omni_cache_hit_tokens_total":
            f"{report.cached_tokens} cached rows checked; vllm:prefix_cache_hits "
            f"+{change.get('vllm:prefix_cache_hits_total', 0):.0f}",
    }
    from omni_cache.integration.metrics import SERIES
    from omni_cache.runtime.errors import ERROR_KINDS

    def order(key: str) -> tuple[int, int, str]:  # in SERIES' order, error kinds in theirs
        series = next((i for i, s in enumerate(SERIES) if key.startswith((s.name + "_", s.name + "{"))
                       or key == s.name), len(SERIES))
        kind = next((i for i, k in enumerate(ERROR_KINDS) if f'kind="{k}"' in key), -1)
        return series, kind, key

    def number(value: float, sign: str = "") -> str:
        return f"{value:{sign},.0f}" if float(value).is_integer() else f"{value:{sign}.4g}"

    lines = [f"cache metrics on {metrics['url']} (change during this run, total):"]
    ours = sorted((k for k in total if k.startswith("vllm:omni_cache_")), key=order)
    width = max(len(k) for k in ours)
    for key in ours:
        note = f"   {beside[key]}" if key in beside else ""
        lines.append(f"  {key:<{width}} {number(change[key], '+')} ({number(total[key])}){note}")
    return lines
