"""Generated spec mutants: small mechanical edits of the TLA+ models that TLC must reject.

Owns: the mutation operators over the actions of ``tla/*/{Staging,Tenancy,Writes}.tla``
(drop a guard conjunct, skip a variable update, swap a state literal, flip a
comparison, negate a guard), generating every mutant in a fixed order,
running each against its model's CI configurations, and the kill table.

A mutant is *killed* when TLC reports an invariant violation (exit 12) or a
property violation (exit 13) for at least one of its model's CI cfgs, or when one of
its model's reachability runs passes: such a run's invariant says a state never
happens (e.g. the committer never stops) and the correct spec violates it, so a
mutant that makes the state unreachable, and the properties about it vacuous, is
caught (``Model.reach``). A pass,
a deadlock (exit 11: deadlock is not a specification property), a parse error
or a crash is *not* a kill. Mutants that change no behaviour are listed with
the reason in ``tla/mutants_equivalent.json``; a survivor that is not listed
there fails the run. A mutant that is not TLA+ at all (SANY rejects it on
every cfg, exit 150-153: e.g. ``\\E x \\notin S :``, a flipped bounded
quantifier) is *stillborn*: shown in the table and counted apart, as in
mutation testing a mutant that does not compile. The operators were written without looking at which
mutants the specs would kill (the models were not tuned to a mutant list).

Upholds (by checking that the models can fail): I1-I3 (Staging), I6/I7
(Tenancy), I8/I9 (Writes).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import omni_cache.verify.tlc_procs as tlc_procs
from omni_cache.verify.tlc import (
    EXIT_INVARIANT,
    EXIT_PARSE,
    EXIT_PROPERTY,
    default_jobs,
    default_tla_dir,
    open_pool,
    parse_tlc_output,
    run_tlc,
)
from omni_cache.verify.tlc_batch import TLCPool
from omni_cache.verify.tools import find_java, find_tla2tools


@dataclass(frozen=True)
class Model:
    """A spec and the CI runs its mutants are checked with (``spec module`` + ``cfg``)."""

    folder: str
    spec: str
    actions: tuple[str, ...]
    states: tuple[str, ...]
    runs: tuple[tuple[str, str], ...]
    extra_modules: tuple[str, ...] = ()
    # (spec module, cfg) runs whose invariant the correct spec violates: reachability, not safety.
    reach: tuple[tuple[str, str], ...] = ()


MODELS: tuple[Model, ...] = (
    Model(
        "staging", "Staging.tla",
        ("claim", "wait", "timeout", "abort", "save", "consume", "done_reading", "reject", "land", "release"),
        ("free", "claimed", "saved", "materialized", "idle", "waiting"),
        (("MCStaging.tla", "MCStaging.cfg"), ("MCStaging.tla", "MCStagingTimeout.cfg"),
         ("MCStaging.tla", "MCStagingFailingCopies.cfg")),
        ("StagingSlot.tla",),
    ),
    Model(
        "tenancy", "Tenancy.tla",
        ("reuse", "register", "land", "plan", "read", "replace", "Preserved", "PreservedLate",
         "LandRows", "ReadResult", "RegisterVersions"),
        ("idle", "planned", "done", "dropped"),
        (("MCTenancy.tla", "MCTenancy.cfg"), ("MCTenancy.tla", "MCTenancyKeys.cfg"),
         ("MCTenancy.tla", "MCTenancyReplaced.cfg"), ("MCTenancy.tla", "MCTenancyLive.cfg")),
    ),
    Model(
        "writes", "Writes.tla",
        ("EndAdmission", "admit", "finish", "register", "enqueue", "start_copy", "finish_copy",
         "commit", "fail", "shutdown", "stop"),
        ("pending", "queued", "copying", "host_ready", "written", "failed"),
        (("MCWrites.tla", "MCWrites.cfg"), ("MCWrites.tla", "MCWritesLive.cfg")),
        ("WriteMachine.tla",),
        (("MCWrites.tla", "MCWritesReachStop.cfg"),),
    ),
)

_HEADER_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\([^)]*\))? ==")
_CONJ_RE = re.compile(r"^(\s*)/\\ (.*)$")
_PRIMED_ASSIGN_RE = re.compile(r"^([a-z][A-Za-z]*)' (=|\\in) ")
_STRING_RE = re.compile(r'"([a-z_]+)"')
# Operators whose call assigns primed variables: a conjunct calling one is not a guard.
_ASSIGNING = re.compile(r"\b(Move|WMove|LandRows|EndAdmission|StillKept)\(")
_CMP = ((" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" >= ", " > "), (" = ", " # "), (" # ", " = "),
        (r" \in ", r" \notin "), (r" \notin ", r" \in "))


@dataclass(frozen=True)
class Mutant:
    """One edit: line ``line`` (0-based) of ``model.spec`` becomes ``new`` (None: deleted)."""

    model: Model
    action: str
    operator: str
    line: int
    old: str
    new: str | None

    @property
    def ident(self) -> str:
        """Stable across edits elsewhere in the spec: names the action, operator and the edit."""
        digest = hashlib.sha1(f"{self.old.strip()}\n{self.new}".encode()).hexdigest()[:8]
        return f"{self.model.folder}:{self.action}:{self.operator}:{digest}"

    def describe(self) -> str:
        after = "(deleted)" if self.new is None else self.new.strip()
        return f"{self.old.strip()}  ->  {after}"

    def apply(self, text: str) -> str:
        lines = text.split("\n")
        assert lines[self.line] == self.old, f"{self.ident}: the spec changed under the mutant"
        if self.new is None:
            del lines[self.line]
        else:
            lines[self.line] = self.new
        return "\n".join(lines)


def _action_spans(lines: list[str], actions: Iterable[str]) -> list[tuple[str, int, int]]:
    """(action, first body line, end line) for each named top-level definition."""
    wanted = set(actions)
    spans = []
    for i, line in enumerate(lines):
        m = _HEADER_RE.match(line)
        if m and m.group(1) in wanted:
            end = i + 1
            while end < len(lines) and lines[end].strip() and not _HEADER_RE.match(lines[end]):
                end += 1
            spans.append((m.group(1), i + 1, end))
    return spans


def _is_single(lines: list[str], i: int, end: int) -> bool:
    """The conjunct on line i does not continue on the next line."""
    if i + 1 >= end:
        return True
    indent = len(lines[i]) - len(lines[i].lstrip())
    nxt = lines[i + 1]
    return (len(nxt) - len(nxt.lstrip())) <= indent


def _balanced(line: str) -> bool:
    """The line closes every bracket it opens (it is not a piece of a larger expression)."""
    depth = 0
    for ch in line:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            return False
    return depth == 0


def generate(model: Model, text: str) -> list[Mutant]:
    """Every mutant of ``model``'s actions, in a fixed order (action by action, line by line)."""
    lines = text.split("\n")
    out: list[Mutant] = []
    for action, start, end in _action_spans(lines, model.actions):
        for i in range(start, end):
            line = lines[i]
            m = _CONJ_RE.match(line)
            conj = m.group(2) if m else None
            single = _is_single(lines, i, end) and _balanced(line)
            if m is not None and conj is not None and single and not conj.startswith("UNCHANGED"):
                assign = _PRIMED_ASSIGN_RE.match(conj)
                if assign:  # skip an update: the variable keeps its value
                    out.append(Mutant(model, action, "skip-update", i, line,
                                      f"{m.group(1)}/\\ UNCHANGED {assign.group(1)}"))
                elif "'" not in conj and "LET" not in conj and not _ASSIGNING.search(conj):  # a guard
                    out.append(Mutant(model, action, "drop-guard", i, line, None))
                    out.append(Mutant(model, action, "negate-guard", i, line,
                                      f"{m.group(1)}/\\ ~({conj})"))
            if "'" not in line or (conj is not None and not _PRIMED_ASSIGN_RE.match(conj)):
                for a, b in _CMP:
                    if a in line:
                        out.append(Mutant(model, action, "flip-comparison", i, line, line.replace(a, b, 1)))
                        break
            for sm in _STRING_RE.finditer(line):
                state = sm.group(1)
                if state in model.states:
                    group = [s for s in model.states if s != state and (s in ("idle", "waiting")) == (state in ("idle", "waiting"))]
                    if group:
                        new = line[: sm.start()] + f'"{group[0]}"' + line[sm.end():]
                        out.append(Mutant(model, action, "swap-state", i, line, new))
                    break
    return out


@dataclass
class MutantResult:
    mutant: Mutant
    verdict: str  # "killed" | "survived" | "equivalent" | "stillborn"
    runs: list[tuple[str, int, str]]  # (cfg, exit code, result)
    reason: str = ""


def _check(mutant: Mutant, tla_dir: Path, java: str, jar: Path, timeout_s: float,
           pool: TLCPool | None = None) -> list[tuple[str, int, str]]:
    folder = tla_dir / mutant.model.folder
    out = []
    with tempfile.TemporaryDirectory(prefix="omni-mutant-") as tmp:
        work = Path(tmp)
        runs = (*mutant.model.runs, *mutant.model.reach)
        for module in (mutant.model.spec, *mutant.model.extra_modules, *{s for s, _ in runs}):
            shutil.copy(folder / module, work / module)
        for _, cfg in runs:
            shutil.copy(folder / cfg, work / cfg)
        spec_path = work / mutant.model.spec
        spec_path.write_text(mutant.apply(spec_path.read_text()))
        for spec, cfg in runs:
            # Deadlock checking off: a stuck mutant must break a property to count as killed.
            run = run_tlc(work / spec, work / cfg, workdir=work / f"tlc-{cfg}", check_deadlock=False,
                          timeout_s=timeout_s, java=java, jar=jar, pool=pool)
            outcome = parse_tlc_output(run.output, run.exit_code, (work / cfg).read_text())
            out.append((cfg, run.exit_code, outcome.result))
            if _kills(mutant.model, cfg, run.exit_code):
                break
    return out


def _kills(model: Model, cfg: str, exit_code: int) -> bool:
    """A run's outcome kills the mutant: a violation of a CI cfg, or a reachability run that passed."""
    if any(cfg == c for _, c in model.reach):
        return exit_code == 0
    return exit_code in (EXIT_INVARIANT, EXIT_PROPERTY)


def load_equivalent(tla_dir: Path) -> dict[str, str]:
    path = tla_dir / "mutants_equivalent.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {k: v for k, v in raw.get("equivalent", {}).items()}


SEED = 20261201
PER_MODEL = 12


def all_mutants(tla_dir: Path | None = None, *, per_model: int | None = PER_MODEL, seed: int = SEED) -> list[Mutant]:
    """The mutants checked: ``per_model`` of each model's generated mutants, sampled with a
    fixed seed (None: every generated mutant)."""
    tla_dir = tla_dir or default_tla_dir()
    out: list[Mutant] = []
    for model in MODELS:
        mutants = generate(model, (tla_dir / model.folder / model.spec).read_text())
        if per_model is not None and per_model < len(mutants):
            keep = sorted(random.Random(f"{seed}:{model.folder}").sample(range(len(mutants)), per_model))
            mutants = [mutants[i] for i in keep]
        out += mutants
    return out


def run_mutants(
    tla_dir: Path | None = None,
    *,
    only: str | None = None,
    per_model: int | None = PER_MODEL,
    jobs: int | None = None,
    timeout_s: float = 120.0,
    on_result: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Check every generated mutant (``only``: those whose id contains it, ignoring case) with TLC."""
    tla_dir = tla_dir or default_tla_dir()
    equivalent = load_equivalent(tla_dir)
    mutants = [m for m in all_mutants(tla_dir, per_model=per_model) if not only or only.lower() in m.ident.lower()]
    java, jar = find_java(), find_tla2tools()
    results: list[MutantResult] = []
    with open_pool(java, jar) as tlc, tlc_procs.executor(jobs or default_jobs()) as pool:
        futures = [pool.submit(_check, m, tla_dir, java, jar, timeout_s, tlc) for m in mutants]
        for mutant, fut in zip(mutants, futures, strict=True):
            runs = fut.result()
            killed = any(_kills(mutant.model, cfg, code) for cfg, code, _ in runs)
            if killed:
                res = MutantResult(mutant, "killed", runs)
            elif runs and all(code in EXIT_PARSE for _, code, _ in runs):
                res = MutantResult(mutant, "stillborn", runs, "not TLA+: SANY rejects the edit")
            elif mutant.ident in equivalent:
                res = MutantResult(mutant, "equivalent", runs, equivalent[mutant.ident])
            else:
                res = MutantResult(mutant, "survived", runs)
            if on_result is not None:
                on_result(res)
            results.append(res)
    return results
