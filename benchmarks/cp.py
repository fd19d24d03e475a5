"""Context parallel (titan_ext's latent gather) on one attention layer: CP=N against the same layer on one GPU.

Run under torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.cp --out benchmarks/results/cp_h200.json

For GLM-5's DSA layer and Kimi-K2's MLA layer (full widths, bf16, one layer), at `--seq` tokens
(default 131072): forward+backward of the whole sequence on rank 0's GPU alone (CP=1), then of
each rank's head-tail share with `SequenceShards` (CP=N): per-rank peak memory and time, the
bytes one layer's latent gathers produced on a rank (counted by the gather itself) against
`latent_gather_bytes` (704 x 2 bytes x tokens for GLM-5), and the balance: slowest / mean of
each rank's own work, timed with the layer's gathers answered from the tensors the real run
gathered (`_Recorded`), so no rank's time includes waiting for a slower one. On rank 0 alone,
the indexer's selection for one rank's queries (`seq / N` of them against all `seq` keys) with
titan_ext's key-chunked running top-k against a dense-logits top-k (a `[seq/N, seq]` fp32 logits
block, as prime-rl builds): peak memory of each.

CPU check of the same code at small sizes (gloo, fp32, no memory figures):

    torchrun --standalone --nproc_per_node 2 -m benchmarks.cp --device cpu --flavor tiny --seq 512 --out /tmp/cp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.builder import build_model_config  # noqa: E402
from titan_ext.models.context_parallel import (  # noqa: E402
    SequenceShards, chunks, flat_segments, latent_gather_bytes, segment_positions,
)
from titan_ext.models.matmul import bmm_fp32  # noqa: E402
from titan_ext.teardown import destroy_process_group_together, exit_without_finalizing  # noqa: E402

from .gpu_bench import Clock, ResultsFile, run_info, torchrun_mesh, zero_grads  # noqa: E402

RESULTS = "benchmarks/results/cp_h200.json"
MODELS = ("glm5", "kimi_k2")


class _Recorded:
    """Stands in for a layer's `SequenceShards` to time one rank's own work: answers each gather
    with the tensor the real gather returned at that point of the step (same shapes, no wait)."""

    def __init__(self, shards: SequenceShards, gathered: list[torch.Tensor]):
        self.shards, self.gathered, self.calls = shards, gathered, 0

    def gather(self, x_BLD: torch.Tensor) -> torch.Tensor:
        out = self.gathered[self.calls % len(self.gathered)]
        self.calls += 1
        return out + 0 * x_BLD.sum()  # keeps x in the graph, as the real gather does

    def __getattr__(self, name):
        return getattr(self.shards, name)


def _layer(model: str, flavor: str, dev: torch.device, dtype: torch.dtype):
    arch = dataclasses.replace(get_arch(model, flavor), n_layers=1, n_dense_layers=1)
    with torch.device(dev):
        layer = build_model_config(arch).layers[0].attention.build()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return layer.to(dtype), arch


def _timed(fn, iters: int, dev: torch.device) -> float:
    """Median milliseconds of fn() after one warm-up run."""
    fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_gib(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _step(layer, x, gy):
    def run():
        zero_grads(layer)
        x.grad = None
        layer(x, None, None).backward(gy)
    return run


def measure_layer(model: str, args, dev, dtype, shards: SequenceShards, clock: Clock) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    entry: dict = {"model": model, "layer": "DSA" if model == "glm5" else "MLA", "tokens": args.seq, "cp": world}
    layer, arch = _layer(model, args.flavor, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(args.seq)
    x_full = torch.randn(1, args.seq, arch.dim, device=dev, dtype=dtype, generator=g)
    gy_full = torch.randn(1, args.seq, arch.dim, device=dev, dtype=dtype, generator=g)
    if rank == 0:
        _reset_peak(dev)
        x = x_full.clone().requires_grad_(True)
        entry["cp1_ms"] = round(_timed(_step(layer, x, gy_full), args.iters, dev), 1)
        entry["cp1_peak_gib"] = _peak_gib(dev)
        clock.log(f"{model} CP=1 T={args.seq}: {entry['cp1_ms']} ms, peak {entry['cp1_peak_gib']} GiB")
        del x
    dist.barrier()
    x_mine, gy_mine = shards.shard(x_full, gy_full)
    del x_full, gy_full
    x = x_mine.clone().requires_grad_(True)
    layer.cp = shards
    _reset_peak(dev)
    step = _step(layer, x, gy_mine)
    ms = _timed(step, args.iters, dev)
    peak = _peak_gib(dev)
    before = shards.gathered_bytes[0]
    with torch.no_grad():
        layer(x, None, None)
    gathered = shards.gathered_bytes[0] - before
    # each rank's own work: the gathers answered with what the real step gathered
    recorded: list[torch.Tensor] = []
    real_gather = shards.gather
    shards.gather = lambda t: recorded.append(real_gather(t).detach()) or recorded[-1]
    with torch.no_grad():
        layer(x, None, None)
    shards.gather = real_gather
    layer.cp = _Recorded(shards, recorded)
    own_ms = _timed(step, args.iters, dev)
    layer.cp = shards
    per_rank = torch.tensor([ms, own_ms, peak or 0.0], dtype=torch.float64, device=dev)
    every = [torch.empty_like(per_rank) for _ in range(world)]
    dist.all_gather(every, per_rank)
    expected = latent_gather_bytes(args.seq, kv_lora_rank=arch.kv_lora_rank, qk_rope_head_dim=arch.qk_rope_head_dim,
                                   index_head_dim=arch.index_head_dim if arch.has_indexer else 0,
                                   dtype_bytes=x.element_size())
    own = [e[1].item() for e in every]
    entry.update({
        "cp_ms_per_rank": [round(e[0].item(), 1) for e in every],
        "cp_own_work_ms_per_rank": [round(v, 1) for v in own],
        "cp_peak_gib_per_rank": [round(e[2].item(), 2) for e in every] if dev.type == "cuda" else None,
        "balance_slowest_over_mean": round(max(own) / statistics.mean(own), 3),
        "gathered_bytes_per_layer": gathered,
        "latent_formula_bytes": expected,
        "gathered_over_formula": round(gathered / expected, 4),
    })
    if dev.type == "cuda" and rank == 0:
        entry["cp_peak_over_cp1"] = round(max(entry["cp_peak_gib_per_rank"]) / entry["cp1_peak_gib"], 3)
        entry["cp1_ms_over_cp_ms"] = round(entry["cp1_ms"] / max(entry["cp_ms_per_rank"]), 3)
    clock.log(f"{model} CP={world}: {entry['cp_ms_per_rank']} ms, own work {entry['cp_own_work_ms_per_rank']} ms, "
              f"peak {entry['cp_peak_gib_per_rank']} GiB, gathered {gathered} B (formula {expected})")
    return entry


def dense_logits_topk(q, k, w, topk: int, segments: list[int], scale: float, query_chunk: int = 128):
    """The selection through a dense `[B, L, S]` fp32 logits block (prime-rl's way), for comparison."""
    bsz, seqlen, h, d = q.shape
    logits = torch.empty(bsz, seqlen, k.size(1), dtype=torch.float32, device=q.device)
    keys = torch.arange(k.size(1), device=q.device)
    for l0, l1, g0 in chunks(segments, query_chunk):
        c = l1 - l0
        s = F.relu_(torch.bmm(q[:, l0:l1].reshape(bsz, c * h, d), k.transpose(1, 2)).view(bsz * c, h, -1))
        mixed = bmm_fp32(w[:, l0:l1].reshape(bsz * c, 1, h).to(s.dtype), s).view(bsz, c, -1) * scale
        mixed.masked_fill_(keys[None, :] > torch.arange(g0, g0 + c, device=q.device)[:, None], float("-inf"))
        logits[:, l0:l1] = mixed
        del s, mixed
    return logits.topk(topk, dim=-1).indices


def measure_indexer(args, dev, dtype, shards: SequenceShards, clock: Clock) -> dict:
    """One rank's queries against the whole sequence's keys, chunked vs dense logits (rank 0's GPU)."""
    layer, arch = _layer("glm5", args.flavor, dev, dtype)
    idx = layer.indexer
    local = args.seq // dist.get_world_size()
    segments = flat_segments(shards.segments(local))
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, local, idx.n_heads, idx.head_dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, args.seq, idx.head_dim, device=dev, dtype=dtype, generator=g)
    w = torch.randn(1, local, idx.n_heads, device=dev, dtype=torch.float32, generator=g)
    entry: dict = {"tokens": args.seq, "queries": local, "topk": idx.topk}
    for name, fn in (("chunked", lambda: idx.select(q, k, w, segments)),
                     ("dense_logits", lambda: dense_logits_topk(q, k, w, idx.topk, segments, idx.head_dim**-0.5))):
        _reset_peak(dev)
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        try:
            with torch.no_grad():
                sel = fn()
            entry[f"{name}_peak_gib_above_inputs"] = (
                round((torch.cuda.max_memory_allocated() - base) / 2**30, 3) if dev.type == "cuda" else None)
            entry[f"{name}_ms"] = round(_timed(lambda: fn(), 1, dev), 1)
            pos = segment_positions(segments, sel.device)[None, :, None]
            entry.setdefault("selections", []).append(torch.where(sel <= pos, sel, -1).sort(-1).values)
        except torch.OutOfMemoryError:
            entry[f"{name}_error"] = "out of memory"
    sels = entry.pop("selections")
    if len(sels) == 2:  # of the keys each query may see (one with fewer than top-k also picks later ones)
        both = torch.cat(sels, -1).sort(-1).values
        common = ((both[..., 1:] == both[..., :-1]) & (both[..., 1:] >= 0)).sum()
        entry["selection_overlap"] = round(common.item() / max(1, (sels[0] >= 0).sum().item()), 5)
    if entry.get("chunked_peak_gib_above_inputs") and entry.get("dense_logits_peak_gib_above_inputs"):
        entry["chunked_over_dense_peak"] = round(
            entry["chunked_peak_gib_above_inputs"] / entry["dense_logits_peak_gib_above_inputs"], 4)
    clock.log(f"indexer T={args.seq}, {local} queries: {entry}")
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--flavor", default="full", help="model flavor (tiny for a CPU check)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dev, mesh = torchrun_mesh(cuda, "cp")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.seq % (2 * world):
        raise SystemExit(f"--seq {args.seq} must be a multiple of 2 x the number of processes ({2 * world})")
    dtype = torch.bfloat16 if cuda else torch.float32
    shards = SequenceShards(mesh, "headtail")
    clock = Clock()
    part: dict = {"cp_run": run_info(__spec__.name, launcher=f"torchrun --nproc_per_node {world}"), "cp_layers": []}
    results = ResultsFile(Path(args.out))
    for model in args.models:
        try:
            part["cp_layers"].append(measure_layer(model, args, dev, dtype, shards, clock))
        except Exception:
            clock.log(f"{model} failed:\n" + traceback.format_exc())
            part["cp_layers"].append({"model": model, "error": traceback.format_exc(limit=3)})
        if rank == 0:
            results.update(part)
    if rank == 0 and "glm5" in args.models:
        part["indexer_topk"] = measure_indexer(args, dev, dtype, shards, clock)
        results.update(part)
    destroy_process_group_together()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
