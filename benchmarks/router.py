"""Router policies on a simulated GRPO rollout workload -> benchmarks/results/router.json.

Why a simulation: the question is where requests go (prefix-cache reuse,
load spread, paused replicas), not how fast a GPU decodes, so a discrete-time
model of vLLM replicas is enough and runs on a laptop CPU in seconds.

Model (one tick is the time unit):

* ``E`` endpoints (8..64), each with ``SLOTS`` concurrent sequences; extra
  requests wait in a FIFO queue. A request holds a slot for a random decode
  time plus a prefill time proportional to its *uncached* prompt blocks.
* GRPO groups of 16 samples arrive at ~85% of capacity; the 16 requests of
  the groups arriving in one tick are shuffled together. Every prompt is a
  shared system prefix (``SYS_BLOCKS``) plus a long group-specific part
  (64..256 blocks of 64 tokens).
* Each endpoint holds an LRU prefix cache of ``CACHE_BLOCKS`` blocks; a
  routed prompt is inserted at routing time (vLLM shares the prefix with
  concurrent requests after the first prefill).
* Every ``UPDATE_EVERY`` ticks a weight update rolls over the endpoints in
  turn: each pauses for ``PAUSE_TICKS`` (no progress) and then serves the new
  policy version.

Policies: ``round_robin``; ``llmd_default`` (llm-d v0.10 queue-scorer min-max
score x2 + kv-cache-utilization ``1-kv`` x2 + prefix-cache ratio x3,
max-score-picker with random tie break); ``moerl`` (router_ext.scorer with
default parameters, group id as affinity key).

Figures: ``hit_rate`` = cached prompt blocks / prompt blocks at routing time;
``oracle_hit_rate`` = the same if only compulsory misses happened (each
group's unique part missed once, the system prefix always hit);
``max_over_mean_load`` = max / mean over endpoints of requests served;
``peak_inflight_max_over_mean`` = time-average of max/mean in-flight;
``paused_picks`` = requests sent to a replica that was paused.
``python_p99_us`` times ``router_ext.scorer.score`` for 64 endpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path

from router_ext.scorer import EndpointSignals, RequestInfo, ScorerParams, score

GROUP = 16
SLOTS = 32
SYS_BLOCKS = 16
CACHE_BLOCKS = 3000
UPDATE_EVERY = 150
PAUSE_TICKS = 6
LOAD = 0.85


class Endpoint:
    """One simulated vLLM replica."""

    def __init__(self, name: str):
        self.name = name
        self.running: list[int] = []  # remaining ticks per running request
        self.queue: deque[int] = deque()  # service ticks of waiting requests
        self.cache: OrderedDict[int, int] = OrderedDict()  # group -> blocks (LRU)
        self.cached_blocks = 0
        self.version = 0
        self.paused_from = -1
        self.paused_until = -1
        self.version_pending = False
        self.served = 0

    def paused(self, t: int) -> bool:
        return self.paused_from <= t < self.paused_until

    def prefix_blocks(self, group: int, blocks: int) -> int:
        """Cached prompt blocks for this group's prompt (system prefix once warm)."""
        if group in self.cache:
            return blocks
        return SYS_BLOCKS if self.served else 0

    def admit(self, group: int, blocks: int, service: int) -> None:
        self.served += 1
        if group in self.cache:
            self.cache.move_to_end(group)
        else:
            self.cache[group] = blocks
            self.cached_blocks += blocks
            while self.cached_blocks > CACHE_BLOCKS:
                _, b = self.cache.popitem(last=False)
                self.cached_blocks -= b
        self.queue.append(service)

    def tick(self, t: int) -> None:
        if self.paused(t):
            return
        self.running = [r - 1 for r in self.running if r > 1]
        while self.queue and len(self.running) < SLOTS:
            self.running.append(self.queue.popleft())


def simulate(policy: str, n_ep: int, ticks: int, seed: int) -> dict:
    rng = random.Random(seed)
    tie_rng = random.Random(seed + 1)
    eps = [Endpoint(f"vllm-{i}") for i in range(n_ep)]
    params = ScorerParams()
    mean_service = 40 + 6
    groups_per_tick = LOAD * n_ep * SLOTS / mean_service / GROUP
    acc = 0.0
    next_group = 0
    hit = total = oracle = 0
    paused_picks = 0
    rr = 0
    ratio_sum, ratio_n = 0.0, 0
    for t in range(ticks):
        # rolling weight update
        if t % UPDATE_EVERY == UPDATE_EVERY - 1:
            for i, e in enumerate(eps):  # one replica after the other
                e.paused_from = t + 1 + i * PAUSE_TICKS
                e.paused_until = e.paused_from + PAUSE_TICKS
                e.version_pending = True
        for e in eps:
            if e.version_pending and t >= e.paused_until:
                e.version += 1
                e.version_pending = False
        acc += groups_per_tick
        arrivals = []
        while acc >= 1.0:
            acc -= 1.0
            blocks = SYS_BLOCKS + rng.randint(64, 256)
            oracle += GROUP * blocks - (blocks - SYS_BLOCKS)
            arrivals += [(next_group, blocks)] * GROUP
            next_group += 1
        rng.shuffle(arrivals)
        for group, blocks in arrivals:
            if policy == "round_robin":
                choice = rr % n_ep
                rr += 1
            elif policy == "llmd_default":
                qs = [len(e.queue) for e in eps]
                qmin, qmax = min(qs), max(qs)
                best, bests = -1.0, []
                for i, e in enumerate(eps):
                    sq = 1.0 if qmax == qmin else (qmax - qs[i]) / (qmax - qmin)
                    kv = min(1.0, len(e.running) / SLOTS)
                    s = 2 * sq + 2 * (1 - kv) + 3 * e.prefix_blocks(group, blocks) / blocks
                    if s > best + 1e-12:
                        best, bests = s, [i]
                    elif abs(s - best) <= 1e-12:
                        bests.append(i)
                choice = tie_rng.choice(bests)
            else:
                sig = [
                    EndpointSignals(
                        e.name,
                        in_flight=len(e.running),
                        waiting=len(e.queue),
                        kv_usage=min(1.0, len(e.running) / SLOTS),
                        prefix_match=e.prefix_blocks(group, blocks) / blocks,
                        policy_version=e.version,
                        updating=e.paused(t),
                    )
                    for e in eps
                ]
                res = score(sig, RequestInfo(f"group-{group}"), params)
                choice = res.pick  # never None here: one replica pauses at a time
            e = eps[choice]
            cached = e.prefix_blocks(group, blocks)
            hit += cached
            total += blocks
            paused_picks += e.paused(t)
            e.admit(group, blocks, rng.randint(20, 60) + (blocks - cached) // 16)
        for e in eps:
            e.tick(t)
        inflight = [len(e.running) + len(e.queue) for e in eps]
        mean = sum(inflight) / n_ep
        if t > ticks // 10 and mean > 0:
            ratio_sum += max(inflight) / mean
            ratio_n += 1
    served = [e.served for e in eps]
    mean_served = sum(served) / n_ep
    return {
        "name": policy,
        "endpoints": n_ep,
        "requests": sum(served),
        "hit_rate": round(hit / total, 4),
        "oracle_hit_rate": round(oracle / total, 4),
        "hit_rate_over_oracle": round(hit / oracle, 4),
        "max_over_mean_load": round(max(served) / mean_served, 4),
        "peak_inflight_max_over_mean": round(ratio_sum / max(ratio_n, 1), 4),
        "paused_picks": paused_picks,
    }


def python_p99_us(n_ep: int = 64, iters: int = 20000, seed: int = 5) -> dict:
    rng = random.Random(seed)
    sig = [
        EndpointSignals(f"vllm-{i}", rng.randint(0, 32), rng.randint(0, 8), rng.random(), rng.random(),
                        rng.choice([7, 8]), rng.random() < 0.05)
        for i in range(n_ep)
    ]
    params = ScorerParams()
    reqs = [RequestInfo(f"group-{k}") for k in range(500)] + [RequestInfo()]
    for r in reqs:
        score(sig, r, params)
    samples = []
    for k in range(iters):
        r = reqs[k % len(reqs)]
        t0 = time.perf_counter_ns()
        score(sig, r, params)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {"p50_us": samples[len(samples) // 2] / 1000, "p99_us": samples[int(0.99 * len(samples))] / 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", default="8,16,32,64")
    ap.add_argument("--ticks", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "router.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    policies = []
    for n in (int(x) for x in args.endpoints.split(",")):
        for name in ("round_robin", "llmd_default", "moerl"):
            r = simulate(name, n, args.ticks, args.seed)
            policies.append(r)
            print(json.dumps(r), flush=True)
    lat = python_p99_us()
    ours = [p for p in policies if p["name"] == "moerl"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    doc = {
        "command": "python -m benchmarks.router " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "workload": {"group_size": GROUP, "slots": SLOTS, "system_prefix_blocks": SYS_BLOCKS,
                     "group_prompt_blocks": "64..256 (+system)", "cache_blocks": CACHE_BLOCKS,
                     "offered_load": LOAD, "ticks": args.ticks, "update_every": UPDATE_EVERY,
                     "pause_ticks": PAUSE_TICKS, "seed": args.seed},
        "scorer_params": ScorerParams().to_plugin_parameters(),
        "policies": policies,
        "python_p99_us": round(lat["p99_us"], 2),
        "python_p50_us": round(lat["p50_us"], 2),
        "targets": {
            "hit_rate_over_oracle_min": min(p["hit_rate_over_oracle"] for p in ours),
            "max_over_mean_load_max": max(p["max_over_mean_load"] for p in ours),
            "met": all(p["hit_rate_over_oracle"] >= 0.95 and p["max_over_mean_load"] <= 1.25 for p in ours)
            and lat["p99_us"] <= 100,
        },
        "wall_s": round(time.time() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["targets"]), "p99_us", doc["python_p99_us"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
