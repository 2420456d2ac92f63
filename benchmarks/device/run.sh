#!/usr/bin/env bash
# The whole CUDA proof in one call: benchmarks/device/run.sh [--dry-run | --cpu] OUTDIR
#
# Made for the nvidia-h200 device machine (Python 3.12, torch 2.11, no network): it installs the
# wheels carried in .whl/ (megatron-core 0.19.2 and gradguard from this working tree; fetched here by
# benchmarks/device/fetch_wheels.sh) into a private folder, offline, then runs
#   1. gradguard doctor
#   2. the CUDA-only tests (CUDA_TESTS below)
#   3. gradguard bench --device cuda                      (defaults; --te only where TE imports)
#   4. gradguard bench --device cuda --preset seed-pp4    (45.4 MiB per micro-batch x 1024; a run
#      whose allocated memory passes 85% of the device stops there: the bench's memory cap)
#   5. gradguard bench --device cuda --preset seed-pp4 --scenario megatron-gpt --micro-batches 64
#   5b. gradguard bench --device cuda --preset seed-pp4 --scenario no-adapter --micro-batches 256 (the seed's
#      engine with no adapter, only the watch: unwatched, then watched in detach, raise and warn mode; the
#      micro-batch it is reported at and CUDA's allocated bytes per micro-batch after the report)
#   6. gradguard bench --device cuda --late-leak (a leak that starts late: the step the watch reports
#      it at, memory after repair, the watch's share of a clean run, CUDA's memory figure)
#      (the real schedule around a GPTModel at the seed-pp4 preset's activation size: >= 2.8 GiB unguarded)
#   7. python -m benchmarks.watch --device cuda (the watch under its defaults: when each kind of leak is
#      reported, memory under detach, a clean run's cost), this tree's benchmarks/ with the carried wheel
# and writes OUTDIR/bench-cuda.{json,md,png}, OUTDIR/late-leak-cuda.png, OUTDIR/watch-cuda.{json,md,png}
# and OUTDIR/run.log (8 files). Every step has a time
# limit and the whole script a budget (GRADGUARD_DEVICE_BUDGET_S, default 450 s); a failing step is
# recorded and the others still run; the exit status is 1 if any step failed.
#
#   --dry-run  check the carried wheels and print every step; run nothing (no GPU, no torch needed)
#   --cpu      every step on the CPU at a small size, files named bench-cpu.*: the check of the
#              script itself on a machine without a GPU (tests/bench/test_device_script.py runs it)
#
# .whl/ is git-ignored: whatever copies this tree to the GPU machine must bring it along (2.3 MiB).
#
# Environment: PYTHON (default python3), GRADGUARD_WHEELS (default .whl), GRADGUARD_SITE (where the
# wheels are installed; default a fresh temporary folder), GRADGUARD_DEVICE_BUDGET_S (default 450).
set -uo pipefail

usage() {
  echo "usage: benchmarks/device/run.sh [--dry-run | --cpu] OUTDIR" >&2
  echo "  the CUDA proof in one call; see the header of this script" >&2
}

mode=cuda
outdir=
for arg in "$@"; do
  case "$arg" in
    --dry-run) mode=dry ;;
    --cpu) mode=cpu ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $arg" >&2; usage; exit 2 ;;
    *)
      if [ -n "$outdir" ]; then echo "run.sh: one OUTDIR, got '$outdir' and '$arg'" >&2; usage; exit 2; fi
      outdir=$arg ;;
  esac
done
if [ -z "$outdir" ]; then echo "run.sh: OUTDIR is missing" >&2; usage; exit 2; fi

repo=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
wheels=${GRADGUARD_WHEELS:-$repo/.whl}
budget=${GRADGUARD_DEVICE_BUDGET_S:-450}
target=$([ "$mode" = cpu ] && echo cpu || echo cuda) # --dry-run prints the CUDA run

# The CUDA-only tests of tests/ (skipped without a GPU); tests/bench/test_device_script.py checks that this
# list is every test there that is skipped unless torch.cuda.is_available().
CUDA_TESTS=(
  tests/boundary/test_offload.py::test_cuda_tensors_land_on_the_host_pinned
  tests/integration/test_megatron_schedule.py::test_real_schedule_on_cuda
)

mkdir -p "$outdir" || exit 2
outdir=$(cd "$outdir" && pwd)
work=$(mktemp -d)
site=${GRADGUARD_SITE:-$work/site}
start=$(date +%s)

# step NAME LIMIT_S COMMAND...: run it under the remaining budget, record NAME, exit status, seconds.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  echo
  echo "=== $name: $*"
  if [ "$mode" = dry ]; then return 0; fi
  if [ "$left" -lt 10 ]; then
    echo "=== $name: not run: the ${budget} s budget is spent"
    printf '%s\tnot run (budget)\t0\t%s\n' "$name" "$*" >> "$work/steps.tsv"
    failed=1
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  local seconds
  seconds=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }")
  [ "$rc" -eq 124 ] && echo "=== $name: stopped at its ${limit} s limit"
  echo "=== $name: exit $rc, ${seconds} s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$*" >> "$work/steps.tsv"
  [ "$rc" -ne 0 ] && failed=1
  return 0
}

main() {
  failed=0
  echo "benchmarks/device/run.sh: mode $mode, OUTDIR $outdir, budget ${budget} s, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "--- the carried wheels ($wheels)"
  "$PYTHON" "$repo/benchmarks/device/check_wheels.py" "$wheels" || { echo "run.sh: the wheels are not usable; run benchmarks/device/fetch_wheels.sh"; return 1; }

  local py=(env -u GRADGUARD PYTHONPATH="$site" PYTHONUNBUFFERED=1 MPLBACKEND=Agg "$PYTHON" -P)
  local pyver
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  local cross=()
  if [ "$pyver" != 3.12 ]; then
    case "$mode" in
      cuda) echo "run.sh: the carried wheels are for CPython 3.12 (the device image); $PYTHON is $pyver"; return 1 ;;
      dry) echo "--- $PYTHON is Python $pyver here; the device's is 3.12, which the wheels are for" ;;
      cpu)
        # the check of the script elsewhere: the same files, placed with pip's cross-version flags
        cross=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --only-binary=:all:)
        echo "--- $PYTHON is Python $pyver, not 3.12: installing the 3.12 wheels with pip's cross-version flags" ;;
    esac
  fi
  step install 120 "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" "${cross[@]}" "$wheels"/*.whl
  if [ "$mode" != dry ]; then
    "${py[@]}" -W ignore -c "import gradguard, megatron.core as m, torch; print('gradguard from', gradguard.__file__); print('megatron-core', m.__version__, 'from', m.__file__); print('torch', torch.__version__, 'CUDA', torch.cuda.is_available())" \
      || { echo "run.sh: the installed wheels do not import"; return 1; }
    if [ "$mode" = cuda ] && ! "${py[@]}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
      echo "run.sh: torch sees no CUDA device here; use --cpu to check the script without one"
      return 1
    fi
  fi

  step doctor 60 "${py[@]}" -m gradguard doctor
  step cuda-tests 150 env GRADGUARD_REQUIRE_ENGINES=1 "${py[@]}" -m pytest -p no:cacheprovider -q -rA \
    --rootdir "$repo" -c "$repo/pyproject.toml" "${CUDA_TESTS[@]/#/$repo/}"

  local bench=("${py[@]}" -m gradguard bench --no-progress)
  # benchmarks/ is not in the wheel: this tree's, after the carried wheel on the path
  local watch=(env -u GRADGUARD PYTHONPATH="$site:$repo" PYTHONUNBUFFERED=1 MPLBACKEND=Agg "$PYTHON" -P -m benchmarks.watch)
  local te=() te_status te_ok=1
  if [ "$mode" = dry ]; then
    echo "--- --te is added to the defaults run only if Transformer Engine imports there"
  else
    te_status=$("${py[@]}" -c "import sys; from gradguard._tools.doctor import te_import_error as e; r = e(); print(r or 'imports'); sys.exit(0 if r is None else 1)")
    te_ok=$?
    if [ "$target" = cpu ]; then
      echo "--- CPU: --te not run (Transformer Engine runs on CUDA only; here: $te_status)"
    elif [ "$te_ok" -eq 0 ]; then
      te=(--te)
      echo "--- Transformer Engine imports: the defaults run adds --te"
    else
      echo "--- Transformer Engine does not import here ($te_status): --te not run"
    fi
  fi
  if [ "$target" = cuda ]; then
    step bench-defaults 90 "${bench[@]}" --device cuda "${te[@]}" --json "$work/defaults.json"
    step bench-seed-pp4 180 "${bench[@]}" --device cuda --preset seed-pp4 --json "$work/seed-pp4.json"
    step bench-megatron-gpt 150 "${bench[@]}" --device cuda --preset seed-pp4 --scenario megatron-gpt \
      --micro-batches 64 --json "$work/megatron-gpt.json"
    step bench-no-adapter 150 "${bench[@]}" --device cuda --preset seed-pp4 --scenario no-adapter \
      --micro-batches 256 --json "$work/no-adapter.json"
    step bench-late-leak 120 "${bench[@]}" --device cuda --late-leak --scenario pp-last-stage \
      --scenario lora-checkpoint --leak-start 300 --steps 600 --clean-steps 1000 --json "$work/late-leak.json"
    step bench-watch 150 "${watch[@]}" --device cuda --scenario pp-last-stage --scenario lora-checkpoint \
      --late-steps 300 --late-start 150 --fast-steps 300 --fast-start 150 --growth-steps 500 --growth-start 405 \
      --clean-steps 1000 --json "$outdir/watch-cuda.json" --md "$outdir/watch-cuda.md" --plot "$outdir/watch-cuda.png"
  else
    # the CPU fallbacks: the same scenarios at the default size, a few micro-batches each (the seed
    # preset refuses on CPU: its scenario runs instead, with an explicit memory cap it stays under)
    step bench-defaults 90 "${bench[@]}" --device cpu --micro-batches 4 --json "$work/defaults.json"
    step bench-seed-pp4 90 "${bench[@]}" --device cpu --scenario pp-last-stage --micro-batches 8 \
      --memory-cap 4 --json "$work/seed-pp4.json"
    step bench-megatron-gpt 120 "${bench[@]}" --device cpu --scenario megatron-gpt --micro-batches 4 \
      --json "$work/megatron-gpt.json"
    step bench-no-adapter 120 "${bench[@]}" --device cpu --scenario no-adapter --micro-batches 8 \
      --json "$work/no-adapter.json"
    step bench-late-leak 120 "${bench[@]}" --device cpu --late-leak --scenario lora-checkpoint \
      --leak-start 20 --steps 40 --clean-steps 40 --json "$work/late-leak.json"
    step bench-watch 150 "${watch[@]}" --device cpu --quick --scenario lora-checkpoint \
      --json "$outdir/watch-cpu.json" --md "$outdir/watch-cpu.md" --plot "$outdir/watch-cpu.png"
  fi

  echo
  echo "=== summary"
  if [ "$mode" != dry ]; then
    "${py[@]}" "$repo/benchmarks/device/summarize.py" --out "$outdir" --label "$target" --steps "$work/steps.tsv" \
      defaults="$work/defaults.json" seed-pp4="$work/seed-pp4.json" megatron-gpt="$work/megatron-gpt.json" \
      no-adapter="$work/no-adapter.json" late-leak="$work/late-leak.json" || failed=1
    cut -f1,2,3 "$work/steps.tsv" | sed 's/^/  /'
  else
    echo "dry run: nothing ran; the steps above would write $outdir/bench-$target.{json,md,png} and $outdir/run.log"
  fi
  echo "elapsed: $(($(date +%s) - start)) s of the ${budget} s budget"
  return $failed
}

if [ "$mode" = dry ]; then
  main
  status=$?
else
  main 2>&1 | tee "$outdir/run.log"
  status=${PIPESTATUS[0]}
fi
rm -rf "$work"
exit "$status"
