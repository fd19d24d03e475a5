"""DeepEP v1 (`deep_ep.Buffer`, intranode over NVLink) as the exchange of titan_ext's lean dispatcher.

TorchTitan 0.3.0's own DeepEP backend needs DeepEP v2 (`ElasticBuffer`, NCCL >= 2.30), which
cannot load on the lent H200s; the v1 wheel `tokenspeed-deepep==1.2.1.post20251110` does
(docs/design.md, "Measured facts", H200 machines). DeepEP sends each token once to every rank that
holds one of its experts and sums the returned copies; the receiving rank lays its rows out
by expert with the same lean permutation as the all-to-all path, over the received top-k ids
(-1 where the choice lives on another rank), and applies the scores itself before the return.

The three Buffer calls are torch custom ops (`titan_ext::deepep_*`) with autograd: the
backward of a dispatch is a combine of the gradients (weights too), the backward of a
combine is a dispatch that reuses the handle. The handle travels as its six tensors.
Eager only: there is no fake implementation (the received row count is data-dependent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .experts import ExpertRoute, LeanTokenDispatcher, _padded, lean_permutation

_BUFFERS: dict[str, object] = {}


def _deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise RuntimeError(
            "the deepep dispatcher needs DeepEP v1 (`deep_ep.Buffer`, e.g. the wheel "
            "tokenspeed-deepep==1.2.1.post20251110) with LD_LIBRARY_PATH reaching nvidia/nvshmem/lib"
        ) from e
    return deep_ep


def _buffer(group_name: str):
    return _BUFFERS[group_name]


def make_buffer(group: dist.ProcessGroup, num_nvl_bytes: int, num_sms: int):
    """The process group's Buffer, made once (it allocates and maps the NVLink buffers of every rank)."""
    deep_ep = _deep_ep()
    if num_sms:
        deep_ep.Buffer.set_num_sms(num_sms)
    if group.group_name not in _BUFFERS:
        _BUFFERS[group.group_name] = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes)
    return _BUFFERS[group.group_name]


@torch.library.custom_op("titan_ext::deepep_dispatch", mutates_args=(), device_types="cuda")
def deepep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group_name: str,
                    num_experts: int) -> list[torch.Tensor]:
    """[recv_x, recv_topk_idx, recv_topk_weights, tokens per local expert (CPU), *handle]."""
    buf = _buffer(group_name)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    return [recv_x, recv_idx, recv_w, torch.tensor(counts, dtype=torch.int64), *handle]


@torch.library.custom_op("titan_ext::deepep_combine", mutates_args=(), device_types="cuda")
def deepep_combine(x: torch.Tensor, topk_weights: torch.Tensor | None, handle: list[torch.Tensor],
                   group_name: str) -> list[torch.Tensor]:
    """[sum of each token's returned copies, summed weights (empty when none were given)]."""
    out, out_w, _ = _buffer(group_name).combine(x, tuple(handle), topk_weights=topk_weights)
    return [out, out_w if out_w is not None else x.new_empty(0)]


@torch.library.custom_op("titan_ext::deepep_dispatch_cached", mutates_args=(), device_types="cuda")
def deepep_dispatch_cached(x: torch.Tensor, handle: list[torch.Tensor], group_name: str) -> torch.Tensor:
    """Dispatch with a previous dispatch's layout (the backward of a combine)."""
    recv_x, *_ = _buffer(group_name).dispatch(x, handle=tuple(handle))
    return recv_x


def _dispatch_setup(ctx, inputs, output):
    ctx.handle, ctx.group_name = output[4:], inputs[3]


def _dispatch_backward(ctx, grads):
    grad_recv_x, _, grad_recv_w = grads[:3]
    grad_x, grad_w = deepep_combine(grad_recv_x.contiguous(), None if grad_recv_w is None else grad_recv_w.contiguous(),
                                    ctx.handle, ctx.group_name)
    return grad_x, None, None if grad_recv_w is None else grad_w, None, None


def _combine_setup(ctx, inputs, output):
    ctx.handle, ctx.group_name = inputs[2], inputs[3]


def _combine_backward(ctx, grads):
    return deepep_dispatch_cached(grads[0].contiguous(), ctx.handle, ctx.group_name), None, None, None


torch.library.register_autograd("titan_ext::deepep_dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("titan_ext::deepep_combine", _combine_backward, setup_context=_combine_setup)


@dataclass(frozen=True)
class _DeepEPState:
    handle: list[torch.Tensor]
    group_name: str


class DeepEPV1TokenDispatcher(LeanTokenDispatcher):
    """The lean dispatcher with DeepEP v1's intranode dispatch/combine as the exchange (EP > 1 only;
    at EP=1 it is the lean local path)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LeanTokenDispatcher.Config):
        num_nvl_bytes: int = 2_000_000_000  # what the DeepEP v1 measurements on the H200 used
        num_sms: int = 0  # SMs for DeepEP's kernels (even); 0 keeps DeepEP's default (20)

    def __init__(self, config: Config):
        super().__init__(config)
        self.num_nvl_bytes, self.num_sms = config.num_nvl_bytes, config.num_sms

    def init_buffer(self) -> None:
        if self.ep_mesh is not None:
            make_buffer(self.ep_mesh.get_group(), self.num_nvl_bytes, self.num_sms)

    def exchange(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E, pad_multiple):
        if self.ep_mesh is None:
            return super().exchange(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E,
                                    pad_multiple)
        if x_TD.dtype != torch.bfloat16:
            raise TypeError(f"DeepEP moves bf16 rows; the MoE input is {x_TD.dtype} (train with bf16 activations)")
        group_name = self.ep_mesh.get_group().group_name
        e = self.num_experts // self.ep_mesh.size()
        recv_x, recv_idx, recv_w, counts, *handle = deepep_dispatch(
            x_TD, topk_expert_ids_TK.to(torch.int64), topk_scores_TK.float(), group_name, self.num_experts)
        with torch.no_grad():
            valid_NK = recv_idx >= 0  # -1: a choice that lives on another rank
            ids_NK = torch.where(valid_NK, recv_idx, e)  # ... laid out as a last, dropped group
            src_R, slot_NK, score_R, counts_E = lean_permutation(
                ids_NK, recv_w, torch.bincount(ids_NK.reshape(-1), minlength=e + 1), pad_multiple)
            host = _padded(counts.tolist(), pad_multiple)  # DeepEP read these on the host already
            r = sum(host)
            mask_NK = valid_NK.to(recv_w.dtype)
            slot_NK = torch.where(valid_NK, slot_NK, 0)  # any real row, with weight 0
        route = ExpertRoute(src_R=src_R[:r], slot_NK=slot_NK, score_R=score_R[:r], weights_NK=recv_w * mask_NK,
                            counts_E=counts_E[:e], counts=host, mask_NK=mask_NK)
        return recv_x, route, _DeepEPState(handle=handle, group_name=group_name)

    def give_back(self, out_ND, state):
        if state is None:
            return out_ND
        out_TD, _ = deepep_combine(out_ND.contiguous(), None, state.handle, state.group_name)
        return out_TD
