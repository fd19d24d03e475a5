#!/usr/bin/env bash
# The main job until the RL loop lands: a short TorchTitan run of the tiny
# Kimi-K2-style model with titan_ext, FSDP2 over 2 gloo processes, then the loss
# curve. Extra arguments go to TorchTitan (e.g. --training.steps 50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mkdir -p outputs
log=outputs/main_job.log
.venv/bin/torchrun --nproc_per_node 2 --local-ranks-filter 0 --tee 3 --log-dir outputs/torchrun \
    .venv/bin/torchtitan train --extension titan_ext --model kimi_k2 --flavor tiny \
    --training.steps 30 --dump_folder outputs/titan "$@" 2>&1 | tee "$log"
.venv/bin/python - "$log" <<'PY'
import re, sys
losses = [float(m.group(1)) for line in open(sys.argv[1])
          for m in [re.search(r"step:\s*\d+\s+loss:\s*([0-9.]+)", re.sub(r"\x1b\[[0-9;]*m", "", line))] if m]
if not losses:
    sys.exit("no loss lines found in the training log")
lo, hi = min(losses), max(losses)
print(f"\nloss curve ({len(losses)} steps): {losses[0]:.3f} -> {losses[-1]:.3f}")
for i, v in enumerate(losses, 1):
    print(f"  step {i:3d} {v:7.3f} " + "#" * int(1 + 50 * (v - lo) / max(hi - lo, 1e-9)))
PY
