"""Bytes each trainer GPU receives per step, by collective.

Ranks are laid out as TorchTitan's mesh does (CP innermost, then the FSDP shard; EP takes
contiguous ranks of FSDP x CP), so a group of at most 8 ranks stays inside one node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_ext.models.cp_volume import latent_gather_bytes

from .layout import Layout, Workload
from .model import ParamCounts

BF16, FP32 = 2, 4


def cp_latent_gather_bytes(arch, tokens: int, dtype_bytes: int = BF16) -> int:
    """Bytes of one layer's gathered latent keys over a sequence of `tokens`: what a DSA/MLA layer
    under titan_ext's context parallel all-gathers once per forward (titan_ext's own formula)."""
    return latent_gather_bytes(
        tokens, kv_lora_rank=arch.kv_lora_rank, qk_rope_head_dim=arch.qk_rope_head_dim,
        index_head_dim=arch.index_head_dim if arch.has_indexer else 0, dtype_bytes=dtype_bytes)


def cp_latent_values(arch) -> int:
    """Values per token a CP rank gathers per layer: the MLA latent key (kv_lora + rope) and,
    for DSA, the indexer key: 512 + 64 + 128 = 704 for GLM-5."""
    return cp_latent_gather_bytes(arch, 1, dtype_bytes=1)


@dataclass(frozen=True)
class CommVolume:
    """Bytes one trainer GPU receives per step."""

    fsdp_all_gather: float
    fsdp_reduce_scatter: float
    replica_all_reduce: float
    ep_all_to_all: float
    cp_gather: float
    weight_sync: float  # sent by this GPU to the inference replicas, per new policy version

    def to_dict(self) -> dict:
        return asdict(self)


def sequences_per_rank(layout: Layout, work: Workload) -> int:
    """Whole sequences each data-parallel group (cp ranks) trains per step."""
    return -(-work.sequences_per_step // (work.trainer_gpus // layout.cp))


def ring(fraction_of: float, n: int) -> float:
    """Bytes a rank receives in a ring all-gather / reduce-scatter of `fraction_of` bytes over n ranks."""
    return fraction_of * (n - 1) / n


def comm_volume(arch, counts: ParamCounts, layout: Layout, work: Workload) -> CommVolume:
    """FSDP2 all-gathers the bf16 weights twice per sequence (forward, and backward after
    resharding) and reduce-scatters fp32 gradients once per sequence; EP exchanges each local
    token's top-k rows at dispatch and combine, forward and backward (and again in the
    recomputed forward under AC); CP gathers each layer's latent keys per forward (MLA
    layers expand the gathered latent into per-head keys and values locally)."""
    seqs = sequences_per_rank(layout, work)
    shard = layout.fsdp * layout.cp
    expert_shard = shard // layout.ep
    non_expert = ring(counts.non_expert, shard)
    experts = ring(counts.routed_experts / layout.ep, expert_shard)
    tokens = work.seq_len // layout.cp
    forwards = 1 if layout.ac == "none" else 2
    ep_rows = ring(tokens * arch.top_k * arch.dim * BF16, layout.ep)
    cp_gather = ring(cp_latent_gather_bytes(arch, work.seq_len), layout.cp)
    replicas = layout.replicas(work.trainer_gpus)
    return CommVolume(
        fsdp_all_gather=seqs * 2 * (non_expert + experts) * BF16,
        fsdp_reduce_scatter=seqs * (non_expert + experts) * FP32,
        replica_all_reduce=2 * ring(counts.total / shard * FP32, replicas),
        ep_all_to_all=seqs * counts.n_moe_layers * 2 * (forwards + 1) * ep_rows,
        cp_gather=seqs * counts.n_layers * forwards * cp_gather,
        weight_sync=counts.total * BF16 / work.trainer_gpus,
    )
