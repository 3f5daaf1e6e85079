"""Running TLC on the TLA+ models of ``tla/`` and judging the outcome.

Owns: loading ``tla/manifest.json`` (java and ``tla2tools.jar`` are located by
``omni_cache.verify.tools``), running one TLC check, parsing its
output (distinct states, the violated invariant or property, deadlock), and
comparing exit code *and* result name with the manifest. A run whose exit code
matches but whose invariant does not is a surprise too.

TLC 2.15 notes: standard modules only; ``-workers 1`` (no ``auto``);
deadlock checking is switched off by the ``-deadlock`` flag, never by a cfg
line; ``-metadir`` and ``java.io.tmpdir`` point into a temporary directory,
so nothing is written into ``tla/``. The CI-size runs go through a pool of driver JVMs
(``omni_cache.verify.tlc_batch``: several runs per JVM, each in a fresh class loader, C1
only), which cuts the JVM start and warm-up that dominate a run of a few hundred states.

Upholds (by checking the models): I1 ExactlyOnce, I2 BoundedStaging,
I3 PageExclusive (tla/staging), I6 NeverSilentMiss, I7 NoStaleTenant
(tla/tenancy), I8 StickyFailure, I9 AbortsLand (tla/writes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import omni_cache.verify.tlc_procs as tlc_procs
from omni_cache.verify.tlc_batch import FAST_JVM_FLAGS, TLCPool, driver_classpath
from omni_cache.verify.tools import find_java, find_tla2tools

# TLC exit codes (tlc2.output.EC.ExitStatus).
EXIT_OK = 0
EXIT_DEADLOCK = 11
EXIT_INVARIANT = 12
EXIT_PROPERTY = 13
EXIT_PARSE = (150, 151, 152, 153)

EXPECT_EXIT = {"ok": EXIT_OK, "deadlock": EXIT_DEADLOCK, "invariant": EXIT_INVARIANT, "property": EXIT_PROPERTY}
TIERS = ("ci", "nightly")
_EXPECT_RE = re.compile(r"^(ok|deadlock|(invariant|property):[A-Za-z_][A-Za-z0-9_]*)$")


class ManifestError(ValueError):
    """``tla/manifest.json`` is malformed or names a file that does not exist."""


# ---- the TLA+ folder ---------------------------------------------------------
def default_tla_dir() -> Path:
    """``tla/`` of this checkout ($OMNI_CACHE_TLA_DIR, the repo root, or ./tla)."""
    explicit = os.environ.get("OMNI_CACHE_TLA_DIR")
    if explicit:
        return Path(explicit)
    beside_package = Path(__file__).resolve().parents[2] / "tla"
    if (beside_package / "manifest.json").is_file():
        return beside_package
    return Path.cwd() / "tla"


# ---- the manifest -----------------------------------------------------------
@dataclass(frozen=True)
class ManifestEntry:
    """One TLC run: ``spec`` checked with ``cfg`` in folder ``model``, and what must happen."""

    model: str
    spec: str
    cfg: str
    expect: str
    exit: int
    why: str = ""
    check_deadlock: bool = True
    # {"table": <StateTable.name>, "variable": <TLA+ variable>, "edges": <edges operator>}
    conformance: dict[str, Any] | None = None
    # "ci" (run by default and by the test suite) or "nightly" (larger constants)
    tier: str = "ci"
    # the measured {"distinct": N, "total": M, "depth": D}; a run that differs has drifted
    states: dict[str, int] | None = None
    # who set ``expect`` and ``exit``, as a surprise says it: the manifest, or an ad-hoc run's --expect
    expected_by: str = "manifest expects"

    @property
    def name(self) -> str:
        return f"{self.model}/{Path(self.cfg).stem}"


def check_expect(expect: str, exit_code: int, where: str) -> None:
    if not _EXPECT_RE.match(expect):
        raise ManifestError(f"{where}: expect {expect!r} is not ok, deadlock, invariant:<Name> or property:<Name>")
    kind = expect.split(":", 1)[0]
    if EXPECT_EXIT[kind] != exit_code:
        raise ManifestError(f"{where}: expect {expect!r} goes with TLC exit {EXPECT_EXIT[kind]}, not {exit_code}")


def check_cfg_checks(cfg_text: str, expect: str, where: str) -> None:
    """A cfg names at least one invariant or property (else TLC checks nothing but deadlock freedom,
    and "ok" would say nothing), and an expected violation names one the cfg checks."""
    invariants, properties = cfg_invariants(cfg_text), cfg_properties(cfg_text)
    if not invariants and not properties:
        raise ManifestError(f"{where}: the cfg names no INVARIANT and no PROPERTY, so TLC would check nothing "
                            "but deadlock freedom; list what to check")
    kind, _, name = expect.partition(":")
    listed = {"invariant": invariants, "property": properties}.get(kind)
    if listed is not None and name not in listed:
        raise ManifestError(f"{where}: expect {expect!r} names {'an' if kind == 'invariant' else 'a'} {kind} the cfg does not check "
                            f"(it checks {', '.join(listed) or f'no {kind}'})")


def load_manifest(tla_dir: Path | None = None) -> list[ManifestEntry]:
    """The runs listed in ``tla/manifest.json``; every named file must exist."""
    tla_dir = tla_dir or default_tla_dir()
    path = tla_dir / "manifest.json"
    if not path.is_file():
        raise ManifestError(f"no manifest at {path} (pass --tla-dir or set OMNI_CACHE_TLA_DIR)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{path} must hold a JSON object with a 'runs' list, got {type(raw).__name__}")
    entries: list[ManifestEntry] = []
    for i, run in enumerate(raw.get("runs", [])):
        where = f"{path} runs[{i}]"
        try:
            entry = ManifestEntry(
                model=run["model"], spec=run["spec"], cfg=run["cfg"], expect=run["expect"],
                exit=int(run["exit"]), why=run.get("why", ""),
                check_deadlock=bool(run.get("check_deadlock", True)),
                conformance=run.get("conformance"), tier=run.get("tier", "ci"),
                states=run.get("states"),
            )
        except KeyError as exc:
            raise ManifestError(f"{where}: missing field {exc}") from exc
        check_expect(entry.expect, entry.exit, where)
        if (tla_dir / entry.model / entry.cfg).is_file():
            check_cfg_checks((tla_dir / entry.model / entry.cfg).read_text(), entry.expect, f"{where} ({entry.cfg})")
        if entry.tier not in TIERS:
            raise ManifestError(f"{where}: tier {entry.tier!r} is not one of {TIERS}")
        for name in (entry.spec, entry.cfg):
            if not (tla_dir / entry.model / name).is_file():
                raise ManifestError(f"{where}: {tla_dir / entry.model / name} does not exist")
        entries.append(entry)
    if not entries:
        raise ManifestError(f"{path} lists no runs")
    return entries


# ---- parsing TLC's output ---------------------------------------------------
_DISTINCT_RE = re.compile(r"^(\d+) states generated, (\d+) distinct states found", re.M)
_DEPTH_RE = re.compile(r"^The depth of the complete state graph search is (\d+)\.", re.M)
_INVARIANT_RE = re.compile(r"^Error: Invariant (\S+) is violated", re.M)
_ACTION_PROP_RE = re.compile(r"^Error: Action property (\S+) is violated", re.M)
_CFG_PROPS_RE = re.compile(r"^\s*PROPERT(?:Y|IES)\b(.*?)(?=^\s*[A-Z_]{4,}\b|\Z)", re.M | re.S)
_CFG_INVS_RE = re.compile(r"^\s*INVARIANTS?\b(.*?)(?=^\s*[A-Z_]{4,}\b|\Z)", re.M | re.S)


def _cfg_names(cfg_text: str, block_re: re.Pattern[str]) -> list[str]:
    text = re.sub(r"\\\*.*", "", cfg_text)
    text = re.sub(r"\(\*.*?\*\)", "", text, flags=re.S)
    names: list[str] = []
    for block in block_re.findall(text):
        names.extend(block.split())
    return names


def cfg_properties(cfg_text: str) -> list[str]:
    """The names after PROPERTY/PROPERTIES in a TLC cfg (comments dropped)."""
    return _cfg_names(cfg_text, _CFG_PROPS_RE)


def cfg_invariants(cfg_text: str) -> list[str]:
    """The names after INVARIANT/INVARIANTS in a TLC cfg (comments dropped)."""
    return _cfg_names(cfg_text, _CFG_INVS_RE)


@dataclass(frozen=True)
class TLCOutcome:
    """What one TLC run said: the result word, state counts, and a one-line detail."""

    result: str
    distinct_states: int | None
    generated_states: int | None
    detail: str = ""
    depth: int | None = None


def parse_tlc_output(output: str, exit_code: int, cfg_text: str = "") -> TLCOutcome:
    """Classify TLC's output as ok / deadlock / invariant:<N> / property:<N> / parse-error / error."""
    counts = _DISTINCT_RE.findall(output)
    generated, distinct = (int(counts[-1][0]), int(counts[-1][1])) if counts else (None, None)
    depths = _DEPTH_RE.findall(output)
    depth = int(depths[-1]) if depths else None
    if exit_code in EXIT_PARSE or "Parsing or semantic analysis failed" in output:
        first = next((ln for ln in output.splitlines() if "rror" in ln), "parse error")
        return TLCOutcome("parse-error", distinct, generated, first.strip(), depth)
    if m := _INVARIANT_RE.search(output):
        return TLCOutcome(f"invariant:{m.group(1)}", distinct, generated, "", depth)
    if m := _ACTION_PROP_RE.search(output):
        return TLCOutcome(f"property:{m.group(1)}", distinct, generated, "", depth)
    if "Error: Temporal properties were violated" in output:
        # TLC 2.15 does not name the violated temporal property: attribute it to
        # the cfg's property when there is exactly one.
        props = cfg_properties(cfg_text)
        name = props[0] if len(props) == 1 else "?"
        detail = "" if len(props) == 1 else f"cfg lists properties {props}; TLC does not say which"
        return TLCOutcome(f"property:{name}", distinct, generated, detail, depth)
    if "Error: Deadlock reached" in output:
        return TLCOutcome("deadlock", distinct, generated, "", depth)
    if exit_code == EXIT_OK and "Model checking completed. No error has been found." in output:
        return TLCOutcome("ok", distinct, generated, "", depth)
    first = next((ln for ln in output.splitlines() if ln.startswith("Error")), f"TLC exit {exit_code}")
    return TLCOutcome("error", distinct, generated, first.strip(), depth)


# ---- running TLC --------------------------------------------------------------
@dataclass(frozen=True)
class TLCRun:
    """The raw result of one TLC process."""

    exit_code: int
    output: str
    seconds: float


def run_tlc(
    spec: Path,
    cfg: Path,
    *,
    workdir: Path,
    check_deadlock: bool = True,
    dump_dot: Path | None = None,
    timeout_s: float = 300.0,
    java: str | None = None,
    jar: Path | None = None,
    pool: TLCPool | None = None,
    short: bool = True,
) -> TLCRun:
    """Run TLC on ``spec`` with ``cfg``; state goes under ``workdir``. With ``pool`` (and the
    cfg in the spec's folder) in one of the pool's JVMs, else in its own (cwd = the spec's
    folder); a pool run that dies or throws is rerun in its own JVM. ``short=False`` (the
    nightly tier: minutes of search) runs alone with C2 and the parallel collector, which
    beat the short-run flags there."""
    java = java or find_java()
    jar = jar or find_tla2tools()
    workdir.mkdir(parents=True, exist_ok=True)
    flags = ["-workers", "1", "-metadir", str(workdir / "states")]
    if not check_deadlock:
        flags.append("-deadlock")
    if dump_dot is not None:
        flags += ["-dump", "dot,actionlabels", str(dump_dot)]
    start = time.perf_counter()
    if pool is not None and short and cfg.resolve().parent == spec.resolve().parent:
        res = pool.run([*flags, "-config", cfg.name, str(spec.resolve())], workdir / "tlc.out", timeout_s)
        if res is not None:
            return TLCRun(res[0], res[1], time.perf_counter() - start)
        start = time.perf_counter()
    jvm = FAST_JVM_FLAGS if short else ("-XX:+UseParallelGC",)
    cmd = [java, *jvm, f"-Djava.io.tmpdir={workdir}", "-cp", str(jar), "tlc2.TLC", *flags,
           "-config", str(cfg.resolve()), spec.name]
    proc = tlc_procs.start(cmd, cwd=spec.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        return TLCRun(-1, stdout + f"\nomni-cache: TLC timed out after {timeout_s:g}s", time.perf_counter() - start)
    except BaseException:  # Ctrl-C in this thread: the JVM goes with it
        proc.kill()
        proc.wait()
        raise
    finally:
        tlc_procs.ended(proc)
    if tlc_procs.stopped():
        raise tlc_procs.TLCStopped("interrupted: this TLC run was ended")
    return TLCRun(proc.returncode, stdout + stderr, time.perf_counter() - start)


@dataclass
class RunResult:
    """One manifest entry checked: what TLC said against what the manifest expects."""

    entry: ManifestEntry
    exit_code: int
    result: str
    distinct_states: int | None
    generated_states: int | None
    seconds: float
    detail: str = ""
    problems: list[str] = field(default_factory=list)
    output_tail: str = ""
    depth: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.entry.model, "spec": self.entry.spec, "cfg": self.entry.cfg,
            "expected": self.entry.expect, "expected_exit": self.entry.exit,
            "result": self.result, "exit": self.exit_code,
            "distinct_states": self.distinct_states, "generated_states": self.generated_states,
            "depth": self.depth, "tier": self.entry.tier,
            "seconds": round(self.seconds, 2), "ok": self.ok, "problems": self.problems,
            "detail": self.detail,
        }


def judge(entry: ManifestEntry, exit_code: int, outcome: TLCOutcome) -> list[str]:
    """Every way the run differs from the manifest (empty: as expected), state counts included.

    With ``-workers 1`` TLC's breadth-first search is deterministic, so the distinct and
    total states and the depth recorded in the manifest must be met exactly: a spec or cfg
    edit that changes the state space without updating the manifest is a drift.
    """
    problems: list[str] = []
    if exit_code == -1:  # killed at --timeout: nothing it printed is a result (no counts to compare)
        return ["TLC timed out before it finished (raise --timeout); its state counts are not a result"]
    if exit_code != entry.exit:
        problems.append(f"TLC exit {exit_code}, {entry.expected_by} {entry.exit}")
    if outcome.result != entry.expect:
        problems.append(f"result {outcome.result}, {entry.expected_by} {entry.expect}")
    if entry.states is not None:
        seen = {"distinct": outcome.distinct_states, "total": outcome.generated_states, "depth": outcome.depth}
        drift = {k: (v, seen.get(k)) for k, v in entry.states.items() if seen.get(k) != v}
        if drift:
            problems.append("state counts drifted (manifest, TLC): " + ", ".join(
                f"{k} {want} != {got}" for k, (want, got) in sorted(drift.items())))
    return problems


def run_entry(
    entry: ManifestEntry,
    tla_dir: Path | None = None,
    *,
    timeout_s: float = 300.0,
    java: str | None = None,
    jar: Path | None = None,
    pool: TLCPool | None = None,
) -> RunResult:
    """Run one manifest entry (and its conformance check, if it has one) and judge it."""
    tla_dir = tla_dir or default_tla_dir()
    folder = tla_dir / entry.model
    cfg_path = Path(entry.cfg) if Path(entry.cfg).is_absolute() else folder / entry.cfg
    with tempfile.TemporaryDirectory(prefix="omni-tlc-") as tmp:
        workdir = Path(tmp)
        graph = workdir / "graph"  # the state graph TLC dumps for a conformance run
        run = run_tlc(
            folder / entry.spec, cfg_path, workdir=workdir, check_deadlock=entry.check_deadlock,
            dump_dot=graph if entry.conformance else None, timeout_s=timeout_s, java=java, jar=jar, pool=pool, short=entry.tier == "ci",
        )
        outcome = parse_tlc_output(run.output, run.exit_code, cfg_path.read_text())
        problems = judge(entry, run.exit_code, outcome)
        if entry.conformance and run.exit_code == EXIT_OK:
            from omni_cache.verify.conformance import check_conformance

            problems += check_conformance(entry.conformance, graph.with_suffix(".dot"), run.output)
    return RunResult(
        entry=entry, exit_code=run.exit_code, result=outcome.result,
        distinct_states=outcome.distinct_states, generated_states=outcome.generated_states,
        seconds=run.seconds, detail=outcome.detail, problems=problems,
        output_tail=run.output[-4000:], depth=outcome.depth,
    )


def default_jobs() -> int:
    """TLC processes at a time: one per core this process may use (each runs ``-workers 1``,
    and most of a small run is JVM start and parsing, which does not parallelise within one run)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def open_pool(java: str, jar: Path) -> Iterator[TLCPool | None]:
    """A pool of TLC driver JVMs (several runs per JVM), or None where it cannot be built
    (no javac, or OMNI_CACHE_TLC_BATCH=0): then every run starts its own JVM."""
    classpath = driver_classpath(java)
    if classpath is None:
        yield None
        return
    with TLCPool(java, jar, classpath) as pool:
        yield pool


def run_manifest(
    entries: Iterable[ManifestEntry],
    tla_dir: Path | None = None,
    *,
    jobs: int | None = None,
    timeout_s: float = 300.0,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run entries (``jobs`` TLC processes at a time, default one per core, each ``-workers 1``),
    in manifest order."""
    entries = list(entries)
    jobs = jobs or default_jobs()
    java, jar = find_java(), find_tla2tools()
    tla_dir = tla_dir or default_tla_dir()
    with open_pool(java, jar) as tlc, tlc_procs.executor(jobs) as pool:
        futures = [
            pool.submit(run_entry, e, tla_dir, timeout_s=timeout_s, java=java, jar=jar, pool=tlc) for e in entries
        ]
        results: list[RunResult] = []
        for fut in futures:
            res = fut.result()
            if on_result is not None:
                on_result(res)
            results.append(res)
    return results


def select(entries: Sequence[ManifestEntry], only: str | None, tier: str | None = None) -> list[ManifestEntry]:
    """Entries whose model, spec or cfg contains ``only`` (case-insensitive), of ``tier``
    ("ci", "nightly"; None or "all": every tier)."""
    chosen = [e for e in entries if tier in (None, "all") or e.tier == tier]
    if not only:
        return chosen
    needle = only.lower()
    return [e for e in chosen if needle in f"{e.model}/{e.spec}/{e.cfg}".lower()]
