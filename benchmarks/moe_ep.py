"""Expert-parallel token dispatch over 2+ GPUs: dispatcher vs raw NCCL all-to-all, same bytes.

Run under torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.moe_ep --out benchmarks/results/moe_block_h200.json

Each rank holds `local experts` of the model (48 for Kimi-K2, 32 for GLM-5: the EP=8
count of the block benchmark), so the model has ranks x local experts in total, and
`tokens` tokens routed top-8 uniformly at random over all of them (about (ranks-1)/ranks
of the routed rows leave the rank). Measured in one run, per case:

* ``dispatcher``: each token dispatcher named by ``--dispatchers`` (titan_ext's
  `--titan_ext.dispatcher` choices: ``lean``, ``torchtitan``, ``deepep`` when `deep_ep` imports)
  with an EP mesh, dispatch then combine, experts replaced by the identity; forward, and
  forward+backward;
* ``all_to_all_single``: `all_to_all_single` of the same rows with the same split sizes, there and
  back (the bytes the dispatcher must move, with nothing else).

Bandwidth counts the bytes that cross between ranks (rows sent to another rank x hidden
x 2 bytes, both directions). Rank 0 writes the result under the key "ep" of `--out`
(other keys kept), so it lands beside the single-GPU block results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import titan_ext  # noqa: F401  (applies patches/ before torchtitan is imported)
from titan_ext.models import get_arch
from titan_ext.models.builder import DISPATCHERS
from torchtitan.distributed.utils import set_spmd_backend

from .gpu_bench import LOCAL_EXPERTS, ResultsFile, moe_arg_parser, run_info


def timed(fn, iters: int, warmup: int, dev) -> float:
    """Median ms over iters, every rank in step (barrier before each run): wall clock, as the
    all-to-alls make every rank wait for the slowest."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def case(model: str, tokens: int, dispatcher: str, mesh, dev, iters: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = get_arch(model, "full")
    d, k = arch.dim, arch.top_k
    n_experts = LOCAL_EXPERTS[model] * world
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    ids = torch.rand(tokens, n_experts, device=dev, generator=g).topk(k, dim=-1).indices
    scores = torch.rand(tokens, k, device=dev, generator=g).requires_grad_(True)
    counts = torch.bincount(ids.reshape(-1), minlength=n_experts)
    disp = DISPATCHERS[dispatcher](num_experts=n_experts, top_k=k).build()
    disp.wire_meshes(ep_mesh=mesh)
    gy = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16, generator=g)

    def fwd():
        routed, _, meta = disp.dispatch(x, scores, ids, counts)
        return disp.combine(routed, meta, x)

    def fwd_bwd():
        x.grad = scores.grad = None
        fwd().backward(gy)

    # the same split sizes, raw
    per_rank = counts.view(world, -1).sum(1)
    in_splits = per_rank.tolist()
    out_counts = torch.empty_like(per_rank)
    dist.all_to_all_single(out_counts, per_rank)
    out_splits = out_counts.tolist()
    send = torch.randn(sum(in_splits), d, device=dev, dtype=torch.bfloat16, generator=g)
    recv = torch.empty(sum(out_splits), d, device=dev, dtype=torch.bfloat16)
    back = torch.empty_like(send)

    def raw():
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        dist.all_to_all_single(back, recv, in_splits, out_splits)

    with torch.no_grad():
        fwd_ms = timed(fwd, iters, 2, dev)
    fb_ms = timed(fwd_bwd, iters, 2, dev)
    raw_ms = timed(raw, iters, 2, dev)
    # bytes leaving this rank plus bytes arriving from others, both directions; max over ranks
    cross = torch.tensor([(sum(in_splits) - in_splits[rank] + sum(out_splits) - out_splits[rank]) * d * 2],
                         device=dev, dtype=torch.float64)
    dist.all_reduce(cross, op=dist.ReduceOp.MAX)
    times = torch.tensor([fwd_ms, fb_ms, raw_ms], device=dev, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    fwd_ms, fb_ms, raw_ms = times.tolist()
    b = float(cross.item())
    return {
        "model": model, "tokens_per_rank": tokens, "dispatcher": dispatcher, "ranks": world, "experts": n_experts,
        "hidden": d, "top_k": k,
        "cross_rank_bytes_per_rank": int(b),
        "dispatcher_fwd_ms": round(fwd_ms, 3), "dispatcher_fwd_gbps": round(b / fwd_ms / 1e6, 1),
        "dispatcher_fwd_bwd_ms": round(fb_ms, 3), "dispatcher_fwd_bwd_gbps": round(2 * b / fb_ms / 1e6, 1),
        "all_to_all_single_ms": round(raw_ms, 3), "all_to_all_single_gbps": round(b / raw_ms / 1e6, 1),
        "dispatcher_fwd_over_all_to_all_single": round(raw_ms / fwd_ms, 3),
    }


def main() -> None:
    ap = moe_arg_parser(__doc__, iters=10)
    ap.add_argument("--dispatchers", nargs="+", choices=list(DISPATCHERS),
                    default=["lean", "torchtitan", *(["deepep"] if importlib.util.find_spec("deep_ep") else [])])
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda" if cuda else "cpu")
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("ep",))
    set_spmd_backend("partial_dtensor")  # functional all_to_all_single on the EP mesh
    cases = []
    for model in args.models:
        for tokens in args.tokens:
            for dispatcher in args.dispatchers:
                c = case(model, tokens, dispatcher, mesh, dev, args.iters)
                cases.append(c)
                if rank == 0:
                    print(json.dumps(c), flush=True)
    if rank == 0:
        ResultsFile(Path(args.out)).update({"ep": {
            **run_info(__spec__.name, launcher=f"torchrun --nproc_per_node {world}"),
            "backend": dist.get_backend(),
            "cases": cases,
        }})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
