"""Expert parallel over 2+ GPUs: the whole MoE block at EP=N against EP=1, and its dispatch against raw NCCL.

Run under torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.moe_ep --out benchmarks/results/moe_ep_h200.json

Each rank holds `local experts` of the model (48 for Kimi-K2, 32 for GLM-5: the EP=8 count of
the block benchmark), so the model has ranks x local experts in total, and `tokens` tokens of
its own. The blocks are `benchmarks.moe_block`'s (`build_moe`: hidden 7168 / 6144, expert dim
2048, top-8, one shared expert, sigmoid router, deterministic random weights), routed by their
own router. Measured in one run, per model, tokens per rank and dispatcher of ``--dispatchers``
(titan_ext's `--titan_ext.dispatcher` choices: ``lean``, ``torchtitan``, ``deepep`` when
`deep_ep` imports), all in the same timing rounds (the clocks of these GPUs drift by a few
percent between seconds-apart runs):

* ``blocks``: the block forward+backward at EP=N (the dispatcher given its EP mesh, the rank's
  local experts) and, on rank 0's GPU, the EP=1 block (lean dispatcher, the same local expert
  count, rank 0's tokens): bf16, and fp8 (`fp8_experts.to_fp8`, weights quantised every step, as
  after each optimizer step) where `builder.check_moe_options` allows it (not with
  ``torchtitan``); each with router replay off and on (5% of the tokens routed differently, as
  in `moe_block`). The fp8 blocks share the bf16 blocks' parameters. Per-GPU TFLOP/s count the
  block's matmuls for the rank's tokens (`moe_block.block_flops`; EP=N's gate scores all N x
  local experts);
* ``dispatch``: the dispatcher alone on the EP=N block's tokens and routing, dispatch then
  combine with the experts replaced by the identity, forward and forward+backward, and
  `all_to_all_single` of the same rows with the same split sizes there and back (the bytes the
  dispatcher must move, with nothing else). Bandwidth counts the bytes that cross between ranks
  (rows sent to another rank x hidden x 2 bytes, both directions, the max over ranks);
* ``ratios``: ``ep_over_ep1_per_gpu`` (EP=N over EP=1 per-GPU TFLOP/s, replay off, per dtype),
  ``dispatcher_over_all_to_all_single`` (the dispatcher's forward bytes/s over raw all-to-all's;
  ``..._fwd_bwd_...`` for forward+backward, twice the bytes), ``fp8_over_bf16`` (TFLOP/s at EP=1
  and EP=N, replay off; null without fp8) and ``replay_ms_on_over_off`` (per dtype and EP
  degree; 1.02 is a 2% replay cost).

``summary`` picks, per model, tokens and dtype, the dispatcher with the fastest EP=N block
(replay off) and repeats its ratios: the figures the EP acceptance of issue #17 names. Times
are wall clock, every rank in step (a barrier before each run; the max over ranks), since the
all-to-alls make every rank wait for the slowest; the EP=1 block runs on rank 0 while the
others wait. Rank 0 writes everything under the key "ep" of `--out` (other keys kept), after
each case. A case that does not fit in the GPU's memory is written as ``{"skipped": reason}``
and the run goes on (on one GPU; with several it ends there, see ``main``). ``--flavor tiny`` (the same
structure at CPU size) makes a CPU/gloo smoke run fit in
memory; its figures are not measurements.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models.builder import DISPATCHERS, check_moe_options  # noqa: E402
from titan_ext.models.fp8_experts import drop_cached_weights, to_fp8  # noqa: E402
from titan_ext.teardown import destroy_process_group_together, exit_without_finalizing  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402

from .gpu_bench import LOCAL_EXPERTS, ResultsFile, moe_arg_parser, run_info, torchrun_mesh, zero_grads  # noqa: E402
from .moe_block import block_flops, block_step, build_moe, routing  # noqa: E402


def timed_rounds(fns: Sequence[Callable[[], object]], iters: int, warmup: int, dev) -> list[float]:
    """Median wall-clock ms of each fn, run in turn round after round (as `gpu_bench.timed_interleaved`),
    every rank in step (a barrier before each run); the max over ranks."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(ts) for ts in times], device=dev, dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.tolist()


def fp8_twin(moe):
    """The block with fp8 experts over the same parameters (two EP degrees x two dtypes of blocks must
    fit on rank 0's GPU). Made before the EP mesh is wired: the copy does not reach the process group."""
    return to_fp8(copy.deepcopy(moe, memo={id(p): p for p in moe.parameters()}))


def dispatch_steps(disp, route, x_TD, gy_TD, mesh, dev):
    """(dispatch+combine forward, forward+backward, raw all-to-all of the same rows there and back),
    and the bytes that cross between ranks (max over ranks)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    k = route.ids.size(-1)
    ids = route.ids.reshape(-1, k)
    x = x_TD.detach().requires_grad_(True)
    scores = route.scores.reshape(-1, k).detach().requires_grad_(True)

    def fwd():
        routed, _, meta = disp.dispatch(x, scores, ids, route.counts)
        return disp.combine(routed, meta, x)

    def fwd_no_grad():
        with torch.no_grad():
            fwd()

    def fwd_bwd():
        x.grad = scores.grad = None
        fwd().backward(gy_TD)

    per_rank = route.counts.view(world, -1).sum(1)
    in_splits = per_rank.tolist()
    out_counts = torch.empty_like(per_rank)
    dist.all_to_all_single(out_counts, per_rank)
    out_splits = out_counts.tolist()
    d = x_TD.size(1)

    def raw():
        # buffers made per call (the caching allocator hands back the same blocks): held only while timed
        send = torch.empty(sum(in_splits), d, device=dev, dtype=torch.bfloat16)
        recv = torch.empty(sum(out_splits), d, device=dev, dtype=torch.bfloat16)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        dist.all_to_all_single(send, recv, in_splits, out_splits)

    # bytes leaving this rank plus bytes arriving from others, both directions
    cross = torch.tensor([(sum(in_splits) - in_splits[rank] + sum(out_splits) - out_splits[rank]) * d * 2],
                         device=dev, dtype=torch.float64)
    dist.all_reduce(cross, op=dist.ReduceOp.MAX)
    return (fwd_no_grad, fwd_bwd, raw), int(cross.item())


def case(model: str, tokens: int, dispatcher: str, ep1: dict, mesh, dev, args) -> dict:
    """One model x tokens per rank x dispatcher: the blocks and the dispatch, timed in the same rounds.
    `ep1`: rank 0's EP=1 blocks by dtype (empty on the other ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = LOCAL_EXPERTS[model]
    ep2, arch = build_moe(model, dev, dispatcher=dispatcher, ranks=world, flavor=args.flavor)
    blocks = {"bf16": ep2}
    if not args.skip_fp8 and _fp8_allowed(dispatcher):
        blocks["fp8"] = fp8_twin(ep2)
    for m in blocks.values():
        m.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    g = torch.Generator(device=dev).manual_seed(tokens * 1000 + rank)  # the same tokens for every dispatcher
    x = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    gy = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g)
    route = routing(ep2, x, g)
    ep1_route = routing(ep1["bf16"], x, g) if ep1 else None

    def noop():
        return None

    # "reference": the EP=1 block on rank 0; "ep": the EP=N block. Labelled by role, not degree,
    # so a 1-process run (N = 1, the GPU check) keeps the two apart.
    labels, fns = [], []
    for dtype, m in blocks.items():
        for replay in (False, True):
            for role, block, r in (("reference", ep1.get(dtype), ep1_route), ("ep", m, route)):
                labels.append((dtype, role, replay))
                if role == "reference" and block is None:  # ranks > 0: wait while rank 0 runs the EP=1 block
                    fns.append(noop)
                else:
                    fns.append(_releasing(block_step(block, x, gy, r.replay_ids, replay, requantise=dtype == "fp8"),
                                          block, x))
    disp_fns, cross = dispatch_steps(ep2.routed_experts.token_dispatcher, route, x.detach()[0], gy[0], mesh, dev)
    ms = timed_rounds([*fns, *disp_fns], args.iters, 2, dev)
    block_ms, (fwd_ms, fb_ms, raw_ms) = ms[:len(fns)], ms[len(fns):]

    ep1_arch = dataclasses.replace(arch, num_experts=local)  # build_moe's arch at ranks=1
    degree = {"reference": 1, "ep": world}
    flops = {"reference": block_flops(ep1_arch, tokens)["total"], "ep": block_flops(arch, tokens)["total"]}
    rows = [{"dtype": dtype, "block": role, "ep": degree[role], "replay": replay, "ms": round(t, 3),
             "tflops_per_gpu": round(flops[role] / t / 1e9, 1), "flops_per_gpu": flops[role]}
            for (dtype, role, replay), t in zip(labels, block_ms)]
    tf = {(dtype, role, replay): flops[role] / t / 1e9 for (dtype, role, replay), t in zip(labels, block_ms)}
    ratios = {
        "ep_over_ep1_per_gpu": {dt: round(tf[dt, "ep", False] / tf[dt, "reference", False], 3) for dt in blocks},
        "fp8_over_bf16": ({f"ep{degree[role]}": round(tf["fp8", role, False] / tf["bf16", role, False], 3)
                           for role in ("reference", "ep")} if "fp8" in blocks else None),
        "replay_ms_on_over_off": {f"{dt}_ep{degree[role]}": round(tf[dt, role, False] / tf[dt, role, True], 4)
                                  for dt in blocks for role in ("reference", "ep")},
        "dispatcher_over_all_to_all_single": round(raw_ms / fwd_ms, 3),
        "dispatcher_fwd_bwd_over_all_to_all_single": round(2 * raw_ms / fb_ms, 3),
    }
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "model": model, "tokens_per_rank": tokens, "dispatcher": dispatcher, "ranks": world,
        "experts": arch.num_experts, "local_experts": local, "flavor": args.flavor, "hidden": arch.dim,
        "top_k": arch.top_k,
        "blocks": rows,
        "dispatch": {
            "cross_rank_bytes_per_rank": cross,
            "fwd_ms": round(fwd_ms, 3), "fwd_gbps": round(cross / fwd_ms / 1e6, 1),
            "fwd_bwd_ms": round(fb_ms, 3), "fwd_bwd_gbps": round(2 * cross / fb_ms / 1e6, 1),
            "all_to_all_single_ms": round(raw_ms, 3), "all_to_all_single_gbps": round(cross / raw_ms / 1e6, 1),
        },
        "ratios": ratios,
        "peak_gib_max_over_ranks": round(peak.item(), 2),
    }


def _releasing(step: Callable[[], None], block, x) -> Callable[[], None]:
    """`step`, then its gradients and fp8 weight copies dropped: the next block timed in the round
    (another EP degree, dtype or replay setting) then finds that memory free. Without this rank 0
    held every block's gradients and fp8 weights at once and the 64k cases ran out of memory."""
    def run():
        step()
        zero_grads(block)
        drop_cached_weights(block)
        x.grad = None
    return run


def _skipped(model: str, tokens: int, dispatcher: str, world: int, err: BaseException) -> dict:
    """The JSON row of a case that could not run, with the reason, so a run reports it and goes on."""
    return {"model": model, "tokens_per_rank": tokens, "dispatcher": dispatcher, "ranks": world,
            "skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}


def _fp8_allowed(dispatcher: str) -> bool:
    try:
        check_moe_options(dispatcher, fp8=True)
    except ValueError:
        return False
    return True


def summary(cases: list[dict]) -> list[dict]:
    """Per model, tokens per rank and dtype: the dispatcher whose EP=N block (replay off) is fastest, and its ratios."""
    best: dict[tuple, tuple[dict, dict]] = {}
    for c in cases:
        for r in c.get("blocks", ()):  # a skipped case has none
            if r["block"] == "ep" and not r["replay"]:
                key = (c["model"], c["tokens_per_rank"], r["dtype"])
                if key not in best or r["ms"] < best[key][0]["ms"]:
                    best[key] = (r, c)
    out = []
    for (model, tokens, dtype), (r, c) in best.items():
        rat = c["ratios"]
        out.append({
            "model": model, "tokens_per_rank": tokens, "dtype": dtype, "best_dispatcher": c["dispatcher"],
            "ep_ms": r["ms"], "ep_tflops_per_gpu": r["tflops_per_gpu"],
            "ep_over_ep1_per_gpu": rat["ep_over_ep1_per_gpu"][dtype],
            "dispatcher_over_all_to_all_single": rat["dispatcher_over_all_to_all_single"],
            "fp8_over_bf16_ep": rat["fp8_over_bf16"][f"ep{c['ranks']}"] if dtype == "fp8" else None,
            "replay_ms_on_over_off_ep": rat["replay_ms_on_over_off"][f"{dtype}_ep{c['ranks']}"],
        })
    return out


def main() -> None:
    ap = moe_arg_parser(__doc__, iters=10)
    ap.add_argument("--dispatchers", nargs="+", choices=list(DISPATCHERS),
                    default=["lean", "torchtitan", *(["deepep"] if importlib.util.find_spec("deep_ep") else [])])
    ap.add_argument("--skip-fp8", action="store_true", help="bf16 blocks only")
    ap.add_argument("--flavor", default="full", help="the models' size (\"tiny\": a CPU smoke run)")
    ap.set_defaults(out="benchmarks/results/moe_ep_h200.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, mesh = torchrun_mesh(cuda, "ep")
    rank, world = dist.get_rank(), dist.get_world_size()
    set_spmd_backend("partial_dtensor")  # functional all_to_all_single on the EP mesh
    results = ResultsFile(Path(args.out))
    res = {**run_info(__spec__.name, launcher=f"torchrun --nproc_per_node {world}"),
           "backend": dist.get_backend(), "cases": [], "summary": []}
    for model in args.models:
        ep1 = {}
        if rank == 0:  # the EP=1 block: rank 0's GPU, the same local experts, lean dispatcher
            ep1["bf16"], _ = build_moe(model, dev, flavor=args.flavor)
            if not args.skip_fp8:
                ep1["fp8"] = fp8_twin(ep1["bf16"])
        for dispatcher in args.dispatchers:
            for tokens in args.tokens:
                try:
                    c = case(model, tokens, dispatcher, ep1, mesh, dev, args)
                except torch.OutOfMemoryError as err:
                    # One GPU: nothing is in flight, the run goes on. Several: another rank may
                    # be inside a collective this rank will not join, so the run ends here,
                    # with the cases measured so far and this one written down.
                    c = _skipped(model, tokens, dispatcher, world, err)
                    if world > 1:
                        res["cases"].append(c)
                        if rank == 0:
                            results.update({"ep": res})
                        raise
                gc.collect()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                res["cases"].append(c)
                res["summary"] = summary(res["cases"])
                if rank == 0:
                    print(json.dumps(c), flush=True)
                    results.update({"ep": res})
                if cuda:
                    torch.cuda.empty_cache()
        del ep1
    if rank == 0:
        for s in res["summary"]:
            print(json.dumps(s), flush=True)
    destroy_process_group_together()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
