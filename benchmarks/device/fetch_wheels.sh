#!/usr/bin/env bash
# Fetch what the device image lacks into .whl/ (git-ignored), for benchmarks/device/run.sh.
#
# The image (nvidia-h200: Python 3.12, torch 2.11, triton, numpy, packaging, wrapt, transformers,
# peft, pytest, hypothesis, matplotlib, tqdm; nothing can be downloaded there) lacks:
#   - megatron-core 0.19.2: its CPython 3.12 manylinux wheel from PyPI (its own requirements, torch,
#     numpy and packaging, are on the image: --no-deps);
#   - gradguard: a wheel built from this working tree (run.sh refuses a wheel older than the tree).
# Run it here, where pip reaches PyPI; rerun it after every change to gradguard/ before a device run.
# It writes SHA256SUMS and FETCHED.txt (what was fetched, how, when) beside the wheels.
#
# usage: benchmarks/device/fetch_wheels.sh        (PYTHON=... picks the interpreter running pip;
#                                                   GRADGUARD_WHEELS=DIR another destination)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
dest=${GRADGUARD_WHEELS:-.whl}
MEGATRON=megatron-core==0.19.2
mkdir -p "$dest"
rm -f "$dest"/*.whl "$dest"/SHA256SUMS "$dest"/FETCHED.txt
pip() { "$PYTHON" -m pip --disable-pip-version-check "$@"; }

download=(download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  -d "$dest" "$MEGATRON")
pip "${download[@]}"
# setuptools builds in build/ and keeps what it copied there before: a module deleted since would
# come back in the wheel. Start from none (build/ is a git-ignored artefact).
rm -rf build
pip wheel --no-deps -w "$dest" .
rm -rf build

(cd "$dest" && sha256sum -- *.whl > SHA256SUMS)
{
  echo "fetched $(date -u +%Y-%m-%dT%H:%M:%SZ) by benchmarks/device/fetch_wheels.sh"
  echo "pip: $(pip --version)"
  echo "1. pip ${download[*]}"
  echo "2. pip wheel --no-deps -w $dest .   (gradguard from the working tree at $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ', with uncommitted changes'))"
  cat "$dest/SHA256SUMS"
} > "$dest/FETCHED.txt"
cat "$dest/FETCHED.txt"
"$PYTHON" benchmarks/device/check_wheels.py "$dest"
