"""Measure and record the state counts of every tla/manifest.json run.

Usage: ``python tools/tla_manifest_states.py [--tier ci|nightly|all] [--jobs 2] [--only writes]``.
Runs TLC on the selected entries (``-workers 1``: deterministic breadth-first
search) and writes each run's ``{"distinct", "total", "depth"}`` into the
manifest's ``states`` field, which ``omni-cache verify`` (and
tests/formal/test_tla_models.py) then require exactly: a drift is a surprise.
Refuses to record a run whose result is not the expected one.
"""

from __future__ import annotations

import argparse
import json
import sys

from omni_cache.verify.tlc import default_tla_dir, load_manifest, run_manifest, select


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tier", default="all", choices=("ci", "nightly", "all"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default=None, help="only runs whose model/spec/cfg contains this")
    args = parser.parse_args(argv)
    tla = default_tla_dir()
    entries = [e for e in select(load_manifest(tla), args.only, args.tier)]
    if not entries:  # nothing measured: the manifest is left as it is
        parser.error(f"no manifest entry matches --only {args.only!r} (tier {args.tier})")
    entries = [e.__class__(**{**e.__dict__, "states": None}) for e in entries]  # measure, don't judge
    results = run_manifest(entries, tla, jobs=args.jobs, timeout_s=1800)
    path = tla / "manifest.json"
    doc = json.loads(path.read_text())
    by_key = {(r.entry.model, r.entry.spec, r.entry.cfg): r for r in results}
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"not recorded: {r.entry.name}: {r.problems}", file=sys.stderr)
    for run in doc["runs"]:
        res = by_key.get((run["model"], run["spec"], run["cfg"]))
        if res is not None and res.ok and res.depth is None:
            print(f"{res.entry.name}: liveness violation, its state counts depend on timing: not pinned")
            run.pop("states", None)
        elif res is not None and res.ok:
            run["states"] = {"distinct": res.distinct_states, "total": res.generated_states, "depth": res.depth}
            print(f"{res.entry.name}: {run['states']} ({res.seconds:.1f} s)")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
