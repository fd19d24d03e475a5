"""Context parallel (CP) for the MLA family: the sequence stays split, only the key side's latents travel.

TorchTitan's own CP wraps the inner attention and gathers per-head K and V (Kimi-K2: 64 heads x
(192 + 128) values per token) and knows no DSA. MLA's keys and values are all derived from one
small per-token latent, so each rank instead all-gathers, per layer, only that latent: the
normalised compressed KV (`kv_lora_rank`), the roped shared key (`qk_rope_head_dim`) and, for
DSA, the indexer's key (`index_head_dim`) - GLM-5: 512 + 64 + 128 = 704 values per token against
a hidden size of 6144. Queries, hidden states and the MoE stay sharded. The gather is
autograd-aware: its backward reduce-scatters (sums) the key gradients back to the rank that owns
each token.

The token layout is TorchTitan's: the trainer shards inputs, labels and positions with
`--parallelism.context_parallel_load_balancer` (default `headtail`: rank r holds chunks r and
2cp-1-r of 2cp, so every rank does the same causal work), and `SequenceShards` derives each
rank's global token positions by sharding `arange(S)` the same way (`cp_shard`). The attention
works on contiguous runs of global positions (`Segment`), which is what its causal masks follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.context_parallel import cp_shard

from .cp_volume import latent_gather_bytes  # noqa: F401  (the formula lives in a torch-free module)

LOAD_BALANCERS = ("headtail", None)


@dataclass(frozen=True)
class Segment:
    """`length` local rows from `local_start` hold global positions `global_start ...`."""

    local_start: int
    global_start: int
    length: int


def segments_of(positions: list[int]) -> tuple[Segment, ...]:
    """Split a rank's global token positions into maximal runs of consecutive positions."""
    runs: list[Segment] = []
    for i, p in enumerate(positions):
        last = runs[-1] if runs else None
        if last is not None and p == last.global_start + last.length:
            runs[-1] = Segment(last.local_start, last.global_start, last.length + 1)
        else:
            runs.append(Segment(i, p, 1))
    return tuple(runs)


def flat_segments(segments: tuple[Segment, ...]) -> list[int]:
    """`segments` as the flat int list custom ops take: [local0, global0, len0, local1, ...]."""
    return [v for s in segments for v in (s.local_start, s.global_start, s.length)]


def chunks(flat: list[int], chunk: int):
    """(local start, local end, global start) of runs of at most `chunk` rows within each segment."""
    for i in range(0, len(flat), 3):
        l0, g0, n = flat[i:i + 3]
        for off in range(0, n, chunk):
            yield l0 + off, l0 + min(n, off + chunk), g0 + off


def segment_positions(flat: list[int], device: torch.device) -> torch.Tensor:
    """`[L]` global positions of the rows `flat` segments describe."""
    return torch.cat([torch.arange(flat[i + 1], flat[i + 1] + flat[i + 2], device=device)
                      for i in range(0, len(flat), 3)])


class _GatherSequence(torch.autograd.Function):
    """All-gather `[B, L, D]` over the group into `[world, B, L, D]`; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x_BLD: torch.Tensor, group, counter: list[int]):
        world = dist.get_world_size(group)
        out = x_BLD.new_empty(world * x_BLD.size(0), *x_BLD.shape[1:])
        dist.all_gather_into_tensor(out, x_BLD.contiguous(), group=group)
        out = out.view(world, *x_BLD.shape)
        counter[0] += out.numel() * out.element_size()
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_WBLD: torch.Tensor):
        grad = grad_WBLD.new_empty(grad_WBLD.shape[1:])
        dist.reduce_scatter_tensor(grad, grad_WBLD.flatten(0, 1).contiguous(), group=ctx.group)
        return grad, None, None


class SequenceShards:
    """One rank's share of the sequence under CP: its positions, and the latent gather."""

    def __init__(self, mesh: DeviceMesh, load_balancer: str | None = "headtail"):
        if load_balancer not in LOAD_BALANCERS:
            raise ValueError(
                f"titan_ext's latent context parallel shards with --parallelism.context_parallel_load_balancer "
                f"headtail (or none); {load_balancer!r} needs FlexAttention block masks, which MLA/DSA do not use"
            )
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.load_balancer = load_balancer
        # Bytes produced by this rank's latent all-gathers (forward only), for the benchmark.
        self.gathered_bytes = [0]
        # Per local length: (positions, segments, rank-order -> global-order permutation), and those
        # as device tensors. Every layer asks for them on every step; rebuilt each time from Python
        # lists (131k positions), they left the H200 idle: the DSA layer through this path at CP=1
        # took 1598 ms against 1416 plain, with the same kernel time; cached, 1427 against 1424.
        self._layouts: dict[int, tuple[list[int], tuple[Segment, ...], list[int]]] = {}
        self._on_device: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def shard(self, *tensors: torch.Tensor, seq_dim: int = 1) -> tuple[torch.Tensor, ...]:
        """This rank's rows of full-sequence tensors, laid out as the trainer lays out its batch."""
        sharded, _ = cp_shard(self.mesh, tensors, None, self.load_balancer, input_seq_dim=seq_dim)
        return tuple(sharded)

    def _layout(self, local_len: int) -> tuple[list[int], tuple[Segment, ...], list[int]]:
        """(this rank's global positions, their segments, the rank-order -> global-order permutation)."""
        if local_len not in self._layouts:
            seqlen = local_len * self.world
            (mine,) = self.shard(torch.arange(seqlen, device=self.mesh.device_type).unsqueeze(0))
            every = mine.new_empty(self.world, mine.size(1))
            dist.all_gather_into_tensor(every, mine.contiguous(), group=self.group)
            restore = torch.argsort(every.reshape(-1))
            positions = mine.reshape(-1).tolist()
            self._layouts[local_len] = (positions, segments_of(positions), restore.tolist())
        return self._layouts[local_len]

    def _tensors(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[1, L]` positions, `[S]` restoring permutation) on `device`."""
        key = (local_len, str(device))
        if key not in self._on_device:
            positions, _, restore = self._layout(local_len)
            self._on_device[key] = (torch.tensor(positions, device=device).unsqueeze(0),
                                    torch.tensor(restore, device=device))
        return self._on_device[key]

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """`[1, L]` global positions of this rank's rows (rope positions when none are given)."""
        return self._tensors(local_len, device)[0]

    def segments(self, local_len: int) -> tuple[Segment, ...]:
        return self._layout(local_len)[1]

    def gather(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """`[B, S, D]`: every rank's rows in global sequence order (gradients go back to their owners)."""
        bsz, local_len, dim = x_BLD.shape
        parts = _GatherSequence.apply(x_BLD, self.group, self.gathered_bytes)
        flat = parts.permute(1, 0, 2, 3).reshape(bsz, self.world * local_len, dim)
        return flat.index_select(1, self._tensors(local_len, x_BLD.device)[1])


def sequence_shards(model: torch.nn.Module) -> SequenceShards | None:
    """The `SequenceShards` the model's attention layers run with (None without context parallel)."""
    for module in model.modules():
        shards = getattr(module, "cp", None)
        if isinstance(shards, SequenceShards):
            return shards
    return None
