"""Async vs synchronous RL step time on one machine (issue: rl_loop acceptance 4).

Runs the same config twice, `max_off_policy_steps=1` (rollouts of step n+1 overlap
training of step n) and `=0` (synchronous), and reports the mean step time (first
step excluded: it includes warm-up) and the fraction of wall time the trainer
waits for rollouts. Both runs use the config's core placement (`train.cpus`,
`inference.cpus`; default: trainer and replicas on disjoint halves of the
machine), recorded in the result. Writes benchmarks/results/rl_step.json.

usage: .venv/bin/python benchmarks/rl_step.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json

from _rl_runs import ROOT, machine, run_rl

from rl_loop.config import RLConfig
from rl_loop.placement import for_config, format_cpus

COMPONENTS = ("gen_s", "score_s", "train_s", "sync_s", "wait_s")


def summarize(records: list[dict]) -> dict:
    steady = records[1:]
    step_s = sum(r["step_s"] for r in steady) / len(steady)
    return {
        "step_s": step_s,
        "trainer_wait_frac": sum(r["trainer_wait_s"] for r in steady) / sum(r["step_s"] for r in steady),
        "components_s": {c: sum(r[c] for r in steady) / len(steady) for c in COMPONENTS},
        "steps": len(records),
        "final_reward": records[-1]["reward"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--config", default="configs/tiny_kimi_k2.toml")
    args = ap.parse_args()
    out = {"command": f"benchmarks/rl_step.py --steps {args.steps} --config {args.config}", "machine": machine()}
    cores = for_config(RLConfig.from_toml(ROOT / args.config))
    out["placement"] = None if cores is None else {
        "trainer": format_cpus(cores.trainer), "replicas": [format_cpus(c) for c in cores.replicas]}
    for name, k in (("async", 1), ("sync", 0)):
        records = run_rl(args.config, ROOT / "outputs" / f"bench_rl_step_{name}",
                         {"train.steps": args.steps, "rollout.max_off_policy_steps": k})
        out[name] = summarize(records)
    out["async_over_sync"] = out["async"]["step_s"] / out["sync"]["step_s"]
    path = ROOT / "benchmarks" / "results" / "rl_step.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
