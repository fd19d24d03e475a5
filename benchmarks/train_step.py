"""Training steps of a reduced-depth Kimi-K2 at full width through the real command, one GPU.

Launches `torchtitan train --extension titan_ext --model kimi_k2 --flavor bench` (full width,
4 layers, 16 experts: `titan_ext/models/kimi_k2`) with `--titan_ext.fp8` and, for comparison,
without it, and reads tokens/s per step from TorchTitan's log. MFU is stated against the dense
bf16 matmul rate measured in the same run on the same GPU (an 8192^3 `torch.matmul`, before
and after the training runs, `gpu_bench.dense_bf16_tflops`), with the model FLOPs counted
here from the architecture:
training = 3 x forward; forward = 2 x the weights a token meets (attention projections, the
dense FFN or its top-k + shared experts and the router, the LM head) + causal attention
(2 x heads x (qk + v head dims) x seq / 2 per layer). TorchTitan's own tflops figure is kept
beside it. Data: the tiny tokenizer and corpus (`titan_ext.train_config.local_assets`), so no
download is needed; the token ids only index the embedding.

With `--short-seq-len N` each precision also trains at N tokens (`runs.fp8_short`, `runs.bf16_short`)
in the same run: how much of a step does not shrink with its tokens (the optimizer step and FSDP's
casts, timed alone by benchmarks.param_costs, and host time). `moerl plan` reads only the full-length
runs; benchmarks/README.md compares the two.

    python -m benchmarks.train_step --out benchmarks/results/train_step_h200.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .gpu_bench import ResultsFile, dense_bf16_tflops, run_info

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)")


def train_flops_per_token(arch, seq_len: int) -> float:
    """3 x forward FLOPs of one token (module docstring)."""
    d, h = arch.dim, arch.n_heads
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    attn = (d * arch.q_lora_rank + arch.q_lora_rank * h * qk + d * (arch.kv_lora_rank + arch.qk_rope_head_dim)
            + arch.kv_lora_rank * h * (arch.qk_nope_head_dim + arch.v_head_dim) + h * arch.v_head_dim * d)
    dense = 3 * d * arch.dense_hidden_dim
    moe = (arch.top_k + arch.num_shared_experts) * 3 * d * arch.moe_hidden_dim + d * arch.num_experts
    n_moe = arch.n_layers - arch.n_dense_layers
    weights = arch.n_layers * attn + arch.n_dense_layers * dense + n_moe * moe + d * arch.vocab_size
    scores = arch.n_layers * 2 * h * (qk + arch.v_head_dim) * seq_len / 2
    return 3 * (2 * weights + scores)


def _spread(tps: list[float]) -> dict | None:
    """How much the timed steps differ: the figure a single median hides on a shared GPU."""
    if not tps:
        return None
    med = statistics.median(tps)
    return {"steps": len(tps), "min": min(tps), "max": max(tps),
            "stdev_over_median": round(statistics.pstdev(tps) / med, 4),
            "max_minus_min_over_median": round((max(tps) - min(tps)) / med, 4)}


def train(flavor: str, steps: int, seq_len: int, batch: int, fp8: bool, timeout_s: int, extra: tuple[str, ...] = (),
          model: str = "kimi_k2") -> dict:
    """One `torchtitan train` run (`extra`: more flags, last); per-step tokens/s and TorchTitan's tflops, from its log."""
    import titan_ext

    titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported
    from titan_ext.train_config import local_assets

    assets = local_assets(model)
    cmd = [shutil.which("torchtitan") or "torchtitan", "train", "--extension", "titan_ext", "--model", model,
           "--flavor", flavor, "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(assets / "corpus"),
           "--training.steps", str(steps), "--training.seq_len", str(seq_len),
           "--training.local_batch_size", str(batch), "--training.mixed_precision_param", "bfloat16",
           "--lr_scheduler.warmup_steps", "1", "--dump_folder", tempfile.mkdtemp(prefix="train_step_"),
           *(["--titan_ext.fp8"] if fp8 else []), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    rows = {int(m[1]): (float(m[2].replace(",", "")), float(m[3].replace(",", ""))) for m in STEP_LINE.finditer(log)}
    if proc.returncode != 0 or not rows:
        print(log[-6000:], file=sys.stderr)
    timed = [rows[s] for s in sorted(rows) if s > 2]  # steps 1-2: allocator and kernel warm-up
    return {
        "command": " ".join(cmd), "seq_len": seq_len, "returncode": proc.returncode, "wall_s": round(time.time() - t0, 1),
        "steps_logged": len(rows), "tps_per_step": [rows[s][0] for s in sorted(rows)],
        "tps_median": statistics.median(t for t, _ in timed) if timed else None,
        "tps_spread": _spread([t for t, _ in timed]),
        "torchtitan_tflops_median": statistics.median(f for _, f in timed) if timed else None,
        "peak_memory": re.findall(r"memory:\s*([\d.]+)GiB\(([\d.]+)%\)", log)[-1:] or None,
        "log_tail": log[-1500:] if proc.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/train_step_h200.json")
    ap.add_argument("--flavor", default="bench")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--timeout-s", type=int, default=240)
    ap.add_argument("--skip-bf16", action="store_true", help="only the fp8 run")
    ap.add_argument("--short-seq-len", type=int, default=2048,
                    help="also train each precision at this length (0: not), for the per-step costs (default 2048)")
    args = ap.parse_args()

    import titan_ext

    titan_ext.activate()  # before torchtitan is imported
    from titan_ext.models import get_arch

    arch = get_arch("kimi_k2", args.flavor)
    flops = train_flops_per_token(arch, args.seq_len)
    res = {**run_info("benchmarks.train_step"),
           "model": {"flavor": args.flavor, "n_layers": arch.n_layers, "dim": arch.dim,
                     "num_experts": arch.num_experts, "top_k": arch.top_k,
                     "tokens_per_step": args.seq_len * args.batch, "train_flops_per_token": flops},
           "dense_bf16_tflops_before": dense_bf16_tflops(), "runs": {}}
    out = ResultsFile(ROOT / args.out)
    precisions = (("fp8", True), ("bf16", False))[:1 if args.skip_bf16 else 2]
    lengths = (("", args.seq_len), ("_short", args.short_seq_len))[:2 if args.short_seq_len else 1]
    for (name, fp8), (suffix, seq_len) in ((p, n) for p in precisions for n in lengths):
        name += suffix
        run = train(args.flavor, args.steps, seq_len, args.batch, fp8, args.timeout_s)
        res["runs"][name] = run
        out.update(res)  # a run cut short keeps what it measured
        print(name, {k: v for k, v in run.items() if k != "log_tail"}, flush=True)
    res["dense_bf16_tflops_after"] = dense_bf16_tflops()
    dense = (res["dense_bf16_tflops_before"] + res["dense_bf16_tflops_after"]) / 2
    for run in res["runs"].values():
        if run["tps_median"]:
            run["model_tflops"] = train_flops_per_token(arch, run["seq_len"]) * run["tps_median"] / 1e12
            run["mfu_vs_measured_dense_bf16"] = run["model_tflops"] / dense
    if {"fp8", "bf16"} <= res["runs"].keys() and res["runs"]["bf16"]["tps_median"] and res["runs"]["fp8"]["tps_median"]:
        res["fp8_speedup_tokens_per_s"] = res["runs"]["fp8"]["tps_median"] / res["runs"]["bf16"]["tps_median"]
    out.update(res)
    print({k: v for k, v in res.items() if k != "runs"})
    for name, run in res["runs"].items():
        print(name, run.get("tps_median"), run.get("model_tflops"), run.get("mfu_vs_measured_dense_bf16"))


if __name__ == "__main__":
    main()
