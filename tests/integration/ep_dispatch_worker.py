"""Run under torchrun on 2 GPUs: titan_ext's DeepEP v1 dispatcher against the lean one at EP=2.

The same bf16 tokens and routing go through each dispatcher's dispatch, a per-expert
function (rows times 1 + the local expert id, so a row given to the wrong expert shows),
and its combine, forward and backward; rank 0 saves {name: (lean, deepep)} for the
output, the token gradient and the score gradient.

usage: torchrun --nproc_per_node 2 ep_dispatch_worker.py OUT_FILE
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models.deepep import DeepEPV1TokenDispatcher  # noqa: E402
from titan_ext.models.experts import LeanTokenDispatcher  # noqa: E402
from titan_ext.teardown import destroy_process_group_together  # noqa: E402

TOKENS, DIM, EXPERTS, TOP_K = 512, 256, 16, 4


def run(dispatcher, x, scores, ids, gy):
    x, scores = x.detach().requires_grad_(True), scores.detach().requires_grad_(True)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    routed, per_expert, meta = dispatcher.dispatch(x, scores, ids, counts)
    factor = (1 + torch.arange(per_expert.numel(), device=x.device)).repeat_interleave(
        per_expert, output_size=routed.size(0))
    out = dispatcher.combine(routed * factor[:, None].to(routed.dtype), meta, x)
    out.backward(gy)
    return out.detach(), x.grad, scores.grad


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(TOKENS, EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
    scores = torch.rand(TOKENS, TOP_K, device="cuda", generator=g)
    gy = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for cls in (LeanTokenDispatcher, DeepEPV1TokenDispatcher):
        d = cls(cls.Config(num_experts=EXPERTS, top_k=TOP_K))
        d.wire_meshes(ep_mesh=mesh)
        results.append(run(d, x, scores, ids, gy))
    if rank == 0:
        names = ("out", "grad_x", "grad_scores")
        torch.save({n: (a.float().cpu(), b.float().cpu()) for n, a, b in zip(names, *results)}, sys.argv[1])
    destroy_process_group_together()


if __name__ == "__main__":
    main()
