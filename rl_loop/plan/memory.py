"""Memory per trainer GPU: parameters, gradients, optimizer state, activations.

Activations are counted tensor by tensor from what titan_ext's layers keep for their
backward (the DSA layer of titan_ext/models/glm5, TorchTitan's MLA, the MoE block with
titan_ext's lean dispatcher), and a layer's peak is the largest of its backward stages:
what is still saved, plus the gradients alive at that stage. tests/unit/test_plan.py holds
these against the peaks measured on an H200 (benchmarks.dsa_layer, benchmarks.moe_memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .comm import cp_latent_values
from .layout import Layout, Workload
from .model import ParamCounts, param_counts

BF16, FP32, INT64 = 2, 4, 8
# The DSA Triton backward's dS / P scratch (titan_ext.models.glm5.sparse_mla_triton.SCRATCH_BYTES).
DSA_BWD_SCRATCH = 2 << 30
# Queries the indexer scores per step (LightningIndexer.Config.query_chunk).
INDEXER_QUERY_CHUNK = 1024
# CUDA context, NCCL buffers and allocator fragmentation: an assumption, not measured.
RESERVED_BYTES = 6e9


@dataclass(frozen=True)
class LayerMemory:
    """One layer's activations: `saved` after its forward (output included, input not), `peak`
    at its largest stage, with the weight gradients of `grad_bytes` that exist at that stage."""

    saved: float
    peak: float
    grad_bytes: float = 0.0

    @property
    def peak_with_grads(self) -> float:
        return self.peak + self.grad_bytes


def _max_stage(stages: list[tuple[float, float]]) -> tuple[float, float]:
    return max(stages, key=lambda s: s[0] + s[1])


def dsa_layer(arch, tokens: int, context: int | None = None) -> LayerMemory:
    """GLM-5's DSA attention on `tokens` local queries whose keys span `context` tokens (CP
    gathers the latent keys of the whole sequence; `context` = `tokens` without CP)."""
    context = context or tokens
    h, c, r = arch.n_heads, arch.kv_lora_rank, arch.qk_rope_head_dim
    per_token = {
        "wq_a out (q_norm input)": arch.q_lora_rank * BF16,
        "q_norm out (wq_b input)": arch.q_lora_rank * BF16,
        "wq_b out (q_nope kept by W_uk absorption)": h * (arch.qk_nope_head_dim + r) * BF16,
        "wkv_a out (kv_norm input)": (c + r) * BF16,
        "q latent + rope": h * (c + r) * BF16,
        "kv latent + rope": (c + r) * BF16,
        "indexer top-k ids": arch.index_topk * INT64,
        "latent attention out": h * c * BF16,
        "lse": h * FP32,
        "wo input": h * arch.v_head_dim * BF16,
        "output": arch.dim * BF16,
    }
    saved = tokens * sum(per_token.values())
    gathered = (context - tokens) * cp_latent_values(arch) * BF16  # other ranks' latent keys, kept for backward
    saved += gathered
    grads = _attention_grad_bytes(arch)
    # backward of the sparse latent attention: the wo input is gone; d(out), dq, fp32 dkv are live
    bwd = saved - tokens * per_token["wo input"] + tokens * (h * c * BF16 + h * (c + r) * BF16) \
        + context * (c + r) * FP32 + min(DSA_BWD_SCRATCH, 2 * arch.index_topk * h * BF16 * tokens)
    # the indexer's forward (no grad): a query chunk's fp32 scores over every key of the context and
    # torch.topk's working copy (on the H200 at 131k: 3.0 GiB above the inputs, 2 GiB of it the ids)
    fwd_indexer = tokens * sum(list(per_token.values())[:4]) + gathered \
        + 2 * min(tokens, INDEXER_QUERY_CHUNK) * context * FP32 \
        + tokens * arch.index_n_heads * arch.index_head_dim * BF16
    peak, g = _max_stage([(bwd, grads), (fwd_indexer, 0.0)])
    return LayerMemory(saved=saved, peak=peak, grad_bytes=g)


def mla_layer(arch, tokens: int, context: int | None = None) -> LayerMemory:
    """TorchTitan's dense MLA attention (Kimi-K2): per-head keys and values materialised, SDPA
    (flash) keeping q, k, v, out and lse. Under CP the other ranks' k and v are held too."""
    context = context or tokens
    h = arch.n_heads
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    kv_b = h * (arch.qk_nope_head_dim + arch.v_head_dim) * BF16
    per_token = (2 * arch.q_lora_rank * BF16 + (arch.kv_lora_rank + arch.qk_rope_head_dim) * BF16
                 + arch.kv_lora_rank * BF16 + kv_b + 2 * h * qk * BF16 + 2 * h * arch.v_head_dim * BF16
                 + h * FP32 + arch.dim * BF16)
    saved = tokens * per_token + (context - tokens) * (h * qk + h * arch.v_head_dim) * BF16
    bwd = (saved + tokens * h * (2 * qk + 2 * arch.v_head_dim) * BF16
           + (context - tokens) * h * (qk + arch.v_head_dim) * BF16)
    return LayerMemory(saved=saved, peak=bwd, grad_bytes=_attention_grad_bytes(arch))


def _attention_grad_bytes(arch) -> float:
    return param_counts(arch).attention_per_layer * BF16


def moe_block(arch, tokens: int, local_experts: int) -> LayerMemory:
    """titan_ext's MoE block (lean dispatcher, bf16 SwiGLU experts) on `tokens` tokens whose
    top-k rows land on `local_experts` experts (EP balanced: as many rows as tokens x top_k).

    Backward stages: the combine (all saved + the routed rows' output gradient) and the
    first routed expert weight (w1: every routed and shared weight gradient exists)."""
    d, f, k = arch.dim * BF16, arch.moe_hidden_dim * BF16, arch.top_k
    rows_in, hidden, rows_out = k * d, k * f, k * d  # per token
    saved_tok = (rows_in + 4 * hidden + rows_out  # routed: gathered rows, h1, silu(h1), h3, product; outputs
                 + 4 * arch.num_shared_experts * f  # shared expert: same four
                 + arch.num_experts * (BF16 + FP32)  # router logits and sigmoid scores
                 + d)  # block output
    routed_grads = 3 * local_experts * arch.dim * arch.moe_hidden_dim * BF16
    shared_grads = 3 * arch.num_shared_experts * arch.dim * arch.moe_hidden_dim * BF16
    combine = (tokens * (saved_tok + rows_out), shared_grads)
    first_weight = (tokens * (saved_tok + rows_in - 3 * hidden), routed_grads + shared_grads)
    peak, g = _max_stage([combine, first_weight])
    return LayerMemory(saved=tokens * saved_tok, peak=peak, grad_bytes=g)


def dense_ffn(arch, tokens: int) -> LayerMemory:
    f = arch.dense_hidden_dim * BF16
    saved = tokens * (4 * f + arch.dim * BF16)
    return LayerMemory(saved=saved, peak=saved + tokens * 3 * f, grad_bytes=3 * arch.dim * arch.dense_hidden_dim * BF16)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per trainer GPU; `total` is the peak that must fit, `host` what AC/optimizer offload
    keeps in host memory. With `optimizer_on_host` the AdamW moments come to the GPU only for the
    optimizer step, when the forward/backward working set (unsharded weights, activations,
    logits) is gone, so the peak holds the larger of the two, not both."""

    params: float
    grads: float
    optimizer: float
    unsharded: float
    activations: float
    logits: float
    reserved: float
    host: float
    attention_layer: LayerMemory
    ffn_layer: LayerMemory
    optimizer_on_host: bool = False

    @property
    def working(self) -> float:
        return self.unsharded + self.activations + self.logits

    @property
    def total(self) -> float:
        state = max(self.optimizer, self.working) if self.optimizer_on_host else self.optimizer + self.working
        return self.params + self.grads + state + self.reserved

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        d["attention_layer"] = asdict(self.attention_layer)
        d["ffn_layer"] = asdict(self.ffn_layer)
        d["total"] = self.total
        return d


def memory_per_gpu(arch, counts: ParamCounts, layout: Layout, work: Workload) -> MemoryBreakdown:
    """FSDP2 mixed precision as moerl (and prime-rl, optimization_dtype = reduce_dtype = float32)
    trains: fp32 master weights and gradients and AdamW's two fp32 moments, sharded over fsdp x cp
    ranks (routed experts over EP, then over the rest); two layers' bf16 weights unsharded in
    flight (one prefetched) and one layer's gradients before their reduce-scatter; activations of
    `seq_len / cp` local tokens. With `work.optim_offload` the moments live in host memory between
    steps (prime-rl's CPUOffloadOptimizer) and count in `host`."""
    shard = layout.fsdp * layout.cp
    local = counts.total / shard
    tokens = work.seq_len // layout.cp
    local_experts = counts.num_experts // layout.ep
    layer_unsharded = max(counts.layer(moe=False),
                          counts.layer(moe=True) - counts.routed_experts_per_layer * (1 - 1 / layout.ep),
                          counts.embedding)
    unsharded = layer_unsharded * (2 * BF16 + BF16 + FP32)
    if layout.fp8:  # one layer's local experts quantised for the fp8 GEMMs
        unsharded += counts.routed_experts_per_layer / layout.ep
    attn = (dsa_layer if arch.has_indexer else mla_layer)(arch, tokens, work.seq_len)
    moe = moe_block(arch, tokens, local_experts)
    dense = dense_ffn(arch, tokens)
    norms = 3 * tokens * arch.dim * BF16  # attention_norm out, residual, ffn_norm out
    layer_input = tokens * arch.dim * BF16
    layer_saved = attn.saved + moe.saved + norms
    # one layer in backward: its FFN's peak with the attention still saved, or the attention's peak
    layer_peak = max(attn.saved + norms + moe.peak, attn.peak + norms)
    chunk = min(tokens, work.loss_chunk or tokens)
    logits = chunk * arch.vocab_size * (BF16 + FP32 + FP32)  # bf16 logits, fp32 log-softmax kept, fp32 grad
    n_moe, n_dense = counts.n_moe_layers, counts.n_dense_layers
    host = 0.0
    if layout.ac == "none":
        dense_saved = attn.saved + dense.saved + norms
        activations = (n_moe * (layer_saved + layer_input) + n_dense * (dense_saved + layer_input)
                       + max(0.0, layer_peak - layer_saved))
    elif layout.ac == "full":
        activations = counts.n_layers * layer_input + layer_peak
    else:
        activations = 2 * layer_input + layer_peak
        host = counts.n_layers * layer_input
    optimizer = 2 * local * FP32
    if work.optim_offload:
        host += optimizer
    return MemoryBreakdown(
        params=local * FP32, grads=local * FP32, optimizer=optimizer, unsharded=unsharded,
        activations=activations, logits=logits, reserved=RESERVED_BYTES, host=host,
        attention_layer=attn, ffn_layer=moe, optimizer_on_host=work.optim_offload)
