"""The Python half of tools/device_check.sh: the CUDA probe, the test selection, the verdicts.

    python3 tools/device_check.py probe            # exit 2 with one line without CUDA; else the machine as JSON
    python3 tools/device_check.py cuda-files       # the test files that hold cuda-marked tests
    python3 tools/device_check.py presets          # the simulated engine's presets
    python3 tools/device_check.py append-log ID LOG OUT_LOG   # a part's log, appended under a lock
    python3 tools/device_check.py summary WORK OUT_JSON [--mode gpu|cpu-dry-run]

The shell script runs each part time-boxed and writes, per command, one line of
``WORK/runs.tsv`` (id, exit code, seconds, time box, stdout file, command); ``summary`` reads those
lines and the parts' own outputs (pytest's JUnit XML or its closing line, ``simulate --json``,
``bench --device cuda --json``, compute-sanitizer's logs) and writes one JSON document: a verdict
per part and for the whole check, never a pass for a part that did not run. It prints a short
table. ``probe`` imports torch and nothing of the project (the wheels are not installed yet).

Verdicts: passed, failed, timed out, skipped (pytest skipped them all), not run; the sanitizer's
tools: clean, errors, refused the device, timed out, not found, failed. The check's exit code:
0 every part passed (every sanitizer tool clean); 1 a part failed or timed out; 3 the rest
passed but some part was skipped, not run, or refused by the device.

Invariants: none (a test harness).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NVIDIA_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")
CUDA_MARK = re.compile(r"\bmark\.cuda\b")
TIMED_OUT = (124, 137)  # timeout(1)'s codes: the box ran out (TERM), or it had to KILL
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
REFUSED = re.compile(r"Device not supported|device is not supported|unsupported device", re.I)
DEVICE_HEADER = "omni-cache test device (OMNI_CACHE_TEST_DEVICE): "


# ---- probe -------------------------------------------------------------------------------------
def no_cuda_reason() -> str | None:
    """Why there is no CUDA device here (None when torch sees one): the driver first, then torch."""
    if not (any(os.path.exists(p) for p in NVIDIA_FILES) or shutil.which("nvidia-smi")):
        return "no NVIDIA driver on this machine (no /dev/nvidiactl, no nvidia-smi)"
    try:
        import torch
    except ImportError as exc:
        return f"{sys.executable} cannot import torch ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees none"
    return None


def _command(*argv: str) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{argv[0]} failed: {exc}"
    return (done.stdout or done.stderr).strip()


def probe(require_cuda: bool) -> int:
    reason = no_cuda_reason()
    if reason is not None and require_cuda:
        print(f"no CUDA device: {reason}; tools/device_check.sh runs on a GPU machine", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable, "cuda": reason is None}
    if reason is not None:
        doc["no_cuda"] = reason
    try:
        import torch

        doc["torch"] = torch.__version__
        doc["torch_cuda"] = torch.version.cuda
        if reason is None:
            props = torch.cuda.get_device_properties(0)
            doc["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                             "memory_gib": round(props.total_memory / 2**30, 1),
                             "multiprocessors": props.multi_processor_count, "count": torch.cuda.device_count()}
    except ImportError:
        pass
    doc["nvidia_smi"] = _command("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                 "--format=csv,noheader")
    doc["compute_sanitizer"] = _command("compute-sanitizer", "--version")
    commit = ROOT / ".whl" / "commit.txt"
    doc["commit"] = commit.read_text().strip() if commit.is_file() else None
    doc["cpus"] = os.cpu_count()
    print(json.dumps(doc))
    return 0


# ---- selections --------------------------------------------------------------------------------
def cuda_files(root: Path = ROOT) -> list[str]:
    """Test files (relative to ``root``) whose text applies the ``cuda`` marker."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if CUDA_MARK.search(p.read_text(encoding="utf-8")))


def presets() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from omni_cache.harness.sim_engine.workload import PRESETS

    return sorted(PRESETS)


def append_log(part: str, log: Path, out_log: Path, max_lines: int = 400) -> None:
    """Append a part's log (its last ``max_lines`` lines) to the check's log, under a lock."""
    lines: list[str] = []
    for path in (log, log.with_suffix(".err")):
        if path.is_file():
            text = path.read_text(errors="replace").splitlines()
            if len(text) > max_lines:
                text = [f"[... {len(text) - max_lines} earlier lines: see the parts archive]", *text[-max_lines:]]
            lines += [f"--- {path.name}", *text]
    with out_log.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(f"\n=== {part} ===\n" + "\n".join(lines) + "\n")
        fcntl.flock(fh, fcntl.LOCK_UN)


# ---- verdicts ----------------------------------------------------------------------------------
def read_runs(work: Path) -> list[dict[str, Any]]:
    runs = []
    tsv = work / "runs.tsv"
    for line in (tsv.read_text().splitlines() if tsv.is_file() else []):
        ident, rc, seconds, box, out, *cmd = line.split("\t")
        runs.append({"id": ident, "rc": int(rc), "seconds": int(seconds), "box": int(box), "out": out,
                     "command": "\t".join(cmd)})
    return runs


def _text(path: str | Path) -> str:
    p = Path(path)
    err = p.with_suffix(".err")
    return (p.read_text(errors="replace") if p.is_file() else "") + (
        err.read_text(errors="replace") if err.is_file() else "")


def pytest_counts(xml_path: Path, log_text: str) -> dict[str, Any]:
    """passed/failed/errors/skipped (and each case) from JUnit XML, else from pytest's closing line."""
    if xml_path.is_file():
        try:
            root = ET.parse(xml_path).getroot()
        except ET.ParseError:
            root = None
        if root is not None:
            cases = []
            for case in root.iter("testcase"):
                outcome = "passed"
                for tag in ("failure", "error", "skipped"):
                    if case.find(tag) is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                cases.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "seconds": float(case.get("time") or 0)})
            counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
            return {**counts, "cases": cases, "from": "junit"}
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", log_text.splitlines()[-1] if log_text else ""):
        counts["error" if word.startswith("error") else word] += int(n)
    return {**counts, "cases": [], "from": "closing line"}


def pytest_part(run: dict[str, Any] | None, xml_path: Path, *, skips_allowed: bool,
                device_header: str | None = None) -> dict[str, Any]:
    if run is None:
        return {"verdict": "not run"}
    text = _text(run["out"])
    counts = pytest_counts(xml_path, text)
    part: dict[str, Any] = {"rc": run["rc"], "seconds": run["seconds"], "box": run["box"], "command": run["command"],
                            **counts}
    header = next((line.split(DEVICE_HEADER, 1)[1].strip() for line in text.splitlines() if DEVICE_HEADER in line),
                  None)
    part["device_header"] = header
    if run["rc"] in TIMED_OUT:
        part["verdict"] = "timed out"
    elif run["rc"] != 0 or counts["failed"] or counts["error"]:
        part["verdict"] = "failed"
    elif counts["passed"] == 0:
        part["verdict"] = "skipped"
    elif counts["skipped"] and not skips_allowed:
        part["verdict"] = "skipped"  # some did not run: not a pass
    elif device_header is not None and not (header or "").startswith(device_header):
        part["verdict"] = "failed"
        part["why"] = f"the tests did not report device {device_header!r} (header: {header!r})"
    else:
        part["verdict"] = "passed"
    return part


def simulate_part(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if not runs:
        return {"verdict": "not run"}
    rows = []
    for run in runs:
        row: dict[str, Any] = {"id": run["id"], "rc": run["rc"], "seconds": run["seconds"], "command": run["command"]}
        try:
            doc = json.loads(Path(run["out"]).read_text())
        except (OSError, ValueError):
            doc = None
        if doc is not None:
            staging = doc.get("staging", {})
            row.update(ok=doc.get("ok"), complete=doc.get("complete"), mode=doc.get("mode"),
                       device=doc.get("config", {}).get("device"), rows_verified=doc.get("rows_verified"),
                       served_from_cache_tokens=doc.get("served_from_cache_tokens"),
                       budget_flushes=staging.get("budget_flushes"), save_ms_p50=staging.get("save_ms_p50"),
                       num_mismatches=doc.get("num_mismatches"), wall_s=doc.get("wall_s"))
        else:
            row["error"] = _text(run["out"]).strip().splitlines()[-1:] or ["no output"]
        row["verdict"] = ("timed out" if run["rc"] in TIMED_OUT else
                          "passed" if run["rc"] == 0 and doc is not None and doc.get("ok") is True else "failed")
        rows.append(row)
    verdicts = {r["verdict"] for r in rows}
    verdict = "passed" if verdicts == {"passed"} else "timed out" if verdicts <= {"passed", "timed out"} else "failed"
    return {"verdict": verdict, "runs": rows}


def bench_part(run: dict[str, Any] | None, dry_run: bool) -> dict[str, Any]:
    if run is None:
        return {"verdict": "not run"}
    part: dict[str, Any] = {"rc": run["rc"], "seconds": run["seconds"], "box": run["box"], "command": run["command"]}
    try:
        doc = json.loads(Path(run["out"]).read_text())
    except (OSError, ValueError):
        doc = None
    if run["rc"] in TIMED_OUT:
        part["verdict"] = "timed out"
    elif dry_run and run["rc"] == 2:
        part["verdict"] = "not run"
        part["why"] = (_text(run["out"]).strip().splitlines() or ["refused"])[-1]
    elif run["rc"] == 0 and doc is not None and doc.get("ground_truth") == "ok":
        part["verdict"] = "passed"
        part["result"] = doc.get("gpu")
    else:
        part["verdict"] = "failed"
        part["error"] = (_text(run["out"]).strip().splitlines() or ["no output"])[-3:]
    return part


def sanitizer_verdict(rc: int, log: str) -> dict[str, Any]:
    """One compute-sanitizer tool's verdict from its exit code and its output."""
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", log)]
    hazards = [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", log)]
    out: dict[str, Any] = {"rc": rc, "errors": sum(errors) if errors else None,
                           "hazards": sum(hazards) if hazards else None,
                           # what the errors are: a CUDA call that returned an error (torch's own
                           # probing can be one: read the log) or a bad access by a kernel
                           "api_errors": len(re.findall(r"Program hit \w+", log)),
                           "access_errors": len(re.findall(r"Invalid __\w+__ (?:read|write)|Misaligned", log))}
    run_line = next((line for line in log.splitlines() if line.startswith("cuda_manager_run:")), None)
    out["run"] = run_line
    if rc == 127 and "not found" in log:
        out["verdict"] = "not found"
    elif REFUSED.search(log):
        out["verdict"] = "refused the device"
        out["why"] = REFUSED.search(log).group(0)  # type: ignore[union-attr]
    elif rc in TIMED_OUT:
        out["verdict"] = "timed out"
    elif (errors and sum(errors)) or (hazards and sum(hazards)):
        out["verdict"] = "errors"
    elif rc == 0 and errors and run_line is not None and run_line.startswith("cuda_manager_run: ok"):
        out["verdict"] = "clean"
    else:
        out["verdict"] = "failed"
    return out


def sanitizer_part(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if not runs:
        return {"verdict": "not run"}
    tools: dict[str, Any] = {}
    for run in runs:
        name = run["id"].split(":", 1)[1]
        text = _text(run["out"])
        tools[name] = {**sanitizer_verdict(run["rc"], text), "seconds": run["seconds"], "command": run["command"]}
        if name == "plain":  # the dry run: the manager run alone, without a sanitizer
            tools[name]["verdict"] = "passed" if run["rc"] == 0 and "cuda_manager_run: ok" in text else "failed"
    verdicts = {t["verdict"] for t in tools.values()}
    if verdicts <= {"clean"} and set(SANITIZER_TOOLS) <= set(tools):
        verdict = "passed"
    elif verdicts & {"errors", "failed", "timed out"}:
        verdict = "failed"
    else:
        verdict = "not run"  # refused the device, not found, or only the dry run's plain run
    return {"verdict": verdict, "tools": tools}


def summarize(work: Path, mode: str, env: dict[str, Any] | None, started: float | None) -> dict[str, Any]:
    runs = read_runs(work)
    by_prefix = lambda p: [r for r in runs if r["id"] == p or r["id"].startswith(p + ":")]  # noqa: E731
    first = lambda p: (by_prefix(p) or [None])[0]  # noqa: E731
    dry = mode == "cpu-dry-run"
    parts = {
        "cuda_tests": pytest_part(first("cuda_tests"), work / "cuda_tests.xml", skips_allowed=False),
        "stateful": pytest_part(first("stateful"), work / "stateful.xml", skips_allowed=True,
                                device_header=None if dry else "cuda"),
        "simulate": simulate_part(by_prefix("simulate")),
        "bench": bench_part(first("bench"), dry),
        "sanitizer": sanitizer_part(by_prefix("sanitizer")),
    }
    not_selected = (work / "not_selected").read_text().split() if (work / "not_selected").is_file() else []
    for name in not_selected:
        parts[name] = {"verdict": "not run", "why": "not selected by --only"}
    verdicts = [p["verdict"] for p in parts.values()]
    if any(v in ("failed", "timed out") for v in verdicts):
        verdict, code = "failed", 1
    elif all(v == "passed" for v in verdicts):
        verdict, code = "passed", 0
    else:
        verdict, code = "incomplete", 3
    doc: dict[str, Any] = {"schema": 1, "mode": mode, "verdict": verdict, "exit_code": code,
                           "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "seconds": None if started is None else round(time.time() - started),
                           "environment": env, "parts": parts}
    if dry:
        doc["note"] = "a CPU dry run of the script's plumbing: no GPU result in it"
    return doc


def _num(value: Any, spec: str = ".3f") -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, spec)


def table(doc: dict[str, Any]) -> str:
    lines = [f"device check ({doc['mode']}): {doc['verdict']} (exit {doc['exit_code']}), {doc['seconds']} s"]
    for name, part in doc["parts"].items():
        extra = ""
        if "passed" in part:
            extra = f"{part['passed']} passed, {part['failed']} failed, {part['error']} errors, {part['skipped']} skipped"
        elif "runs" in part:
            extra = ", ".join(f"{r['id'].split(':', 1)[1]} {r['verdict']}" for r in part["runs"])
        elif "tools" in part:
            extra = ", ".join(f"{k} {v['verdict']}" for k, v in part["tools"].items())
        elif part.get("result"):
            extra = f"pinned D2H {_num(part['result'].get('d2h_gbps_pinned'), '.1f')} GB/s"
            for c in part["result"].get("cases", []):
                extra += (f"\n    hidden {c.get('hidden')} x {c.get('tokens')}: save {_num(c.get('save_ms'))} ms "
                          f"(engine thread), copy {_num(c.get('copy_ms'))} ms (side stream, "
                          f"{_num(c.get('copy_vs_floor'), '.2f')}x the D2H floor), overlap "
                          f"{_num(c.get('overlap_fraction'), '.0%')}, forward {_num(c.get('forward_ms_base'), '.2f')} ms")
        if part.get("why"):
            extra += f" ({part['why']})"
        lines.append(f"  {name:<11} {part['verdict']:<10} {extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--allow-cpu", action="store_true", help="report the machine without CUDA instead of exiting 2")
    sub.add_parser("cuda-files")
    sub.add_parser("presets")
    a = sub.add_parser("append-log")
    a.add_argument("part")
    a.add_argument("log", type=Path)
    a.add_argument("out_log", type=Path)
    s = sub.add_parser("summary")
    s.add_argument("work", type=Path)
    s.add_argument("out_json", type=Path)
    s.add_argument("--mode", choices=("gpu", "cpu-dry-run"), default="gpu")
    s.add_argument("--quiet", action="store_true", help="write the JSON, print nothing")
    args = parser.parse_args(argv)
    if args.cmd == "probe":
        return probe(require_cuda=not args.allow_cpu)
    if args.cmd == "cuda-files":
        print(" ".join(cuda_files()))
        return 0
    if args.cmd == "presets":
        print(" ".join(presets()))
        return 0
    if args.cmd == "append-log":
        append_log(args.part, args.log, args.out_log)
        return 0
    env_file = args.work / "environment.json"
    env = json.loads(env_file.read_text()) if env_file.is_file() else None
    started_file = args.work / "started"
    started = float(started_file.read_text()) if started_file.is_file() else None
    doc = summarize(args.work, args.mode, env, started)
    tmp = args.out_json.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(args.out_json)  # atomic: parts that finish together each rewrite it whole
    if not args.quiet:
        print(table(doc))
    return doc["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
