"""Mismatch of an fp8-served policy against the trainer, with and without replay -> benchmarks/results/fp8_mismatch.json.

RL at scale serves fp8: the trainer holds bf16/fp32 weights and weight sync sends them to the
replicas in the checkpoint's block-fp8 format (`titan_ext.weights.iter_hf_weights(quant=...)`).
This runs the `moerl mismatch` command (trainer = titan_ext model in fp32 on the original
weights, own routing vs replayed routing) on the same tiny Kimi-K2 (r3_mismatch.py's checkpoint:
bf16, init scale 0.1, made by `moerl make-tiny-checkpoint`) with two samplers:

* `bf16` (`--served-weights trainer`): the replica serves the trainer's weights in bf16
  (r3_mismatch.py's setting, rerun here so both rows come from one run);
* `fp8_dequantized_on_load` (`--served-weights block-fp8-dequantized`): the replica serves what
  block-fp8 weight sync sends, dequantized on load to bf16 (rl_loop/mismatch.py says what that
  reference path models and what it does not).

usage: .venv/bin/python -m benchmarks.fp8_mismatch [--num-samples 256] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._rl_runs import MOERL, ROOT

SERVERS = (("bf16", "trainer"), ("fp8_dequantized_on_load", "block-fp8-dequantized"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18630)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "fp8_mismatch"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_mismatch.json"))
    args = ap.parse_args()
    cache = Path(args.cache)
    ckpt = cache / "kimi_k2-bf16-0.1"
    subprocess.run([*MOERL, "make-tiny-checkpoint", "--arch", "kimi_k2", "--out", str(ckpt), "--dtype", "bfloat16",
                    "--init-scale", "0.1"], check=True, cwd=ROOT)
    rows = {}
    for name, served in SERVERS:
        json_out = cache / f"{name}.json"
        cmd = [*MOERL, "mismatch", "--hf-checkpoint", str(ckpt), "--served-weights", served, "--name", name,
               "--json-out", str(json_out), "--num-samples", str(args.num_samples),
               "--max-tokens", str(args.max_tokens), "--port", str(args.port), "--log-dir", str(cache / f"{name}-logs")]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        r = json.loads(json_out.read_text())
        rows[name] = {k: r[k] for k in ("served_weights", "served_quantization", "kl_no_replay", "kl_replay",
                                        "kl_max_no_replay", "kl_max_replay", "kl_floor", "extreme_frac_no_replay",
                                        "extreme_frac_replay", "kl_mean_reduction", "kl_max_reduction",
                                        "tokens_any_layer_differs", "num_completions")}
        rows[name]["command"] = " ".join(cmd).replace(str(ROOT) + "/", "")
        rows[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    report = {
        "benchmark": "fp8_mismatch",
        "command": "python -m benchmarks.fp8_mismatch " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": "kimi_k2 tiny, bf16 checkpoint, init scale 0.1; trainer = titan_ext fp32 on the bf16 weights",
        "definitions": {
            "kl_*": "k3 estimator exp(d)-d-1, d = logp_trainer - logp_vllm, over completion tokens (mean, max)",
            "fp8_dequantized_on_load": "served weights = block-fp8 export of the trainer's weights (128x128 blocks, "
                                       "e4m3), dequantized to bf16 on load: weight rounding only, activations bf16",
        },
        "served": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
