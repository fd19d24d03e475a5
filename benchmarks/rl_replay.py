"""Router replay on vs off in `moerl rl`: trainer-vs-inference mismatch per step (rl_loop acceptance 2).

Same config and seed twice, replay on and off, bf16 inference on weights scaled so
routing matters (init 0.1). Runs synchronously (`max_off_policy_steps=0`) so the
trainer's forward uses exactly the weights that sampled the batch: the k3 KL then
measures engine mismatch only, not policy drift. Writes
benchmarks/results/rl_replay.json with both runs' per-step k3 and the ratios.

Completions are `--max-tokens` long (default 32, the main config uses 8): routing flips
compound along a sequence, so longer completions show the mismatch replay removes more clearly.

usage: .venv/bin/python benchmarks/rl_replay.py [--steps 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json

from _rl_runs import ROOT, machine, run_rl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--config", default="configs/tiny_kimi_k2.toml")
    args = ap.parse_args()
    out = {"command": f"benchmarks/rl_replay.py --steps {args.steps} --max-tokens {args.max_tokens} "
                      f"--config {args.config}", "machine": machine()}
    runs = {}
    for name, replay in (("replay", True), ("no_replay", False)):
        runs[name] = run_rl(args.config, ROOT / "outputs" / f"bench_rl_{name}",
                            {"train.steps": args.steps, "train.replay": replay, "rollout.max_off_policy_steps": 0,
                             "rollout.max_tokens": args.max_tokens})
        out[name] = {
            "k3_mean_per_step": [r["k3_mean"] for r in runs[name]],
            "k3_max_per_step": [r["k3_max"] for r in runs[name]],
            "k3_mean": sum(r["k3_mean"] for r in runs[name]) / len(runs[name]),
            "k3_max": max(r["k3_max"] for r in runs[name]),
            "extreme_frac": sum(r["extreme_frac"] for r in runs[name]) / len(runs[name]),
        }
    out["mean_ratio"] = out["no_replay"]["k3_mean"] / out["replay"]["k3_mean"]
    out["max_ratio"] = out["no_replay"]["k3_max"] / out["replay"]["k3_max"]
    path = ROOT / "benchmarks" / "results" / "rl_replay.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
