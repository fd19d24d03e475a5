#!/usr/bin/env bash
# The GPU check in one command, for a bare GPU machine (the lent H200s: torch 2.11, no internet).
# Installs the wheels carried in .whl/ (docs/gpu.md lists them) and this checkout, for the
# `torchtitan` entry point, into /tmp/site, then runs `python -m benchmarks.gpu_check "$@"`.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${MOERL_GPU_SITE:-/tmp/site}
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check.sh: no wheels in .whl/ (see docs/gpu.md)" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" .
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
exec python3 -m benchmarks.gpu_check "$@"
