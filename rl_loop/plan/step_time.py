"""Predicted trainer step time from the rates measured on one H200 (and two for EP).

Per sequence and rank: the attention layers at the measured DSA / dense MLA times (fitted as
a*N + b*N^2 through the two measured lengths, the quadratic part per packed sample, split over
CP ranks), the MoE blocks at the measured titan_ext block TFLOP/s, the dense FFNs and LM head
at the measured dense matmul rate, one more forward under activation checkpointing, plus the EP
all-to-all and CP gathers (on the critical path), whatever FSDP traffic the compute does not
hide, and with optimizer-state offload the time the moments' copies add to a step (measured
for titan_ext's offload by benchmarks.long_context). The optimizer step and FSDP's copy-in/out
casts cost the same whatever the tokens: they are charged per local parameter, at the rates
benchmarks.param_costs measured for each alone. What all these parts leave out (norms, residual
adds, the router's top-k, the loss, fp8 weight quantisation, framework time) is calibrated on a
whole training step measured on one H200 (benchmarks.train_step): the measured step time minus
the same parts predicted for that step, per token and layer, added per local token and layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .comm import FP32, CommVolume, sequences_per_rank
from .layout import GPUS_PER_NODE, Layout, Workload
from .model import load_arch, param_counts
from .rates import DSAPoint, Rate, Rates


@dataclass(frozen=True)
class StepTime:
    """Seconds per step on each trainer rank, by part; `rates` lists every rate used with its source."""

    attention: float
    moe: float
    dense: float
    recompute: float
    per_parameter: float
    unmodelled: float
    ep_all_to_all: float
    cp_gather: float
    fsdp_exposed: float
    optimizer_offload: float
    sequences_per_rank: int
    rates: dict[str, str]

    @property
    def total(self) -> float:
        return (self.attention + self.moe + self.dense + self.recompute + self.per_parameter + self.unmodelled
                + self.ep_all_to_all
                + self.cp_gather + self.fsdp_exposed + self.optimizer_offload)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t(N) = a*N + b*N^2 through the first and last point."""
    (n1, t1), (n2, t2) = points[0], points[-1]
    b = (t2 / n2 - t1 / n1) / (n2 - n1)
    return t1 / n1 - b * n1, b


def _attention_flops(arch) -> tuple[float, float]:
    """(per-token projection flops, per-token-pair core flops) of one MLA layer, forward."""
    h, qk = arch.n_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    proj = 2 * (arch.dim * arch.q_lora_rank + arch.q_lora_rank * h * qk
                + arch.dim * (arch.kv_lora_rank + arch.qk_rope_head_dim)
                + arch.kv_lora_rank * h * (arch.qk_nope_head_dim + arch.v_head_dim) + h * arch.v_head_dim * arch.dim)
    return proj, 2 * h * (qk + arch.v_head_dim)


def attention_seconds(arch, points: list[DSAPoint], seq_len: int, cp: int, glm5_arch, doc_len: int = 0) -> float:
    """One attention layer's fwd+bwd on one of `cp` ranks sharing a `seq_len` sequence packed
    with samples of `doc_len` tokens (0: one sample fills it); each sample attends only to itself,
    so the quadratic part is paid per sample.

    GLM-5: the measured DSA layer (linear sparse attention + quadratic indexer). Other MLA
    models: the dense MLA attention measured at GLM-5's widths, its linear part scaled by
    the projection flops and its quadratic part by the core attention flops of the model."""
    if arch.has_indexer:
        a, b = fit_quadratic([(p.tokens, p.ms.value) for p in points])
    else:
        a, b = fit_quadratic([(p.tokens, p.dense_ms.value) for p in points])
        (proj, core), (proj_g, core_g) = _attention_flops(arch), _attention_flops(glm5_arch)
        a, b = a * proj / proj_g, b * core / core_g
    doc = doc_len or seq_len
    return (a * seq_len + b * doc * seq_len) / cp / 1e3


def moe_flops_per_token(arch) -> float:
    """fwd+bwd flops of one MoE block per token: gate, top_k routed and the shared experts' SwiGLU."""
    d, f = arch.dim, arch.moe_hidden_dim
    return 3 * (2 * 3 * d * f * (arch.top_k + arch.num_shared_experts) + 2 * d * arch.num_experts)


def compute_parts(arch, glm5_arch, counts, model: str, fp8: bool, seq_len: int, cp: int, seqs: int,
                  rates: Rates, doc_len: int = 0) -> tuple[float, float, float, dict[str, Rate]]:
    """(attention, MoE, dense + LM head) seconds of `seqs` sequences on one rank, and the rates used."""
    tokens = seq_len // cp
    moe_rate = rates.moe_block_tflops(model, fp8, tokens)
    dense_rate = rates.dense_tflops()
    attention = seqs * counts.n_layers * attention_seconds(arch, rates.dsa_points(), seq_len, cp, glm5_arch, doc_len)
    moe = seqs * counts.n_moe_layers * tokens * moe_flops_per_token(arch) / (moe_rate.value * 1e12)
    dense_flops = 3 * 2 * tokens * (counts.n_dense_layers * counts.dense_ffn_per_layer + counts.output)
    dense = seqs * dense_flops / (dense_rate.value * 1e12)
    return attention, moe, dense, {"moe_block_tflops": moe_rate, "dense_matmul_tflops": dense_rate}


def unmodelled_per_token_layer(glm5_arch, fp8: bool, rates: Rates) -> Rate:
    """Seconds per token and layer that a measured whole training step took beyond its predicted parts."""
    model, flavor, tokens, tps = rates.train_step(fp8)
    arch = load_arch(model, flavor)
    counts = param_counts(arch)
    parts = sum(compute_parts(arch, glm5_arch, counts, model, fp8, tokens, 1, 1, rates)[:3])
    parts += counts.total * rates.per_parameter_seconds().value  # every parameter is local on one GPU
    measured = tokens / tps.value
    return Rate((measured - parts) / (tokens * counts.n_layers), "s per token-layer",
                f"{tps.source} ({model} {flavor}, {tokens} tokens, {tps.value:g} tokens/s = {measured:.3f} s "
                f"against {parts:.3f} s predicted)")


def host_copy_gbps(rates: Rates) -> Rate:
    """GB/s at which titan_ext's optimizer offload moves AdamW's moments out and back in a step
    (copy-out overlapped with the forward as it runs): the moments of the Kimi-K2 `bench` run over
    the step time the offload added, measured side by side on one H200."""
    model, tokens, without, with_offload = rates.optimizer_offload_pair()
    moments = 2 * param_counts(load_arch(model, "bench")).total * FP32
    added = tokens / with_offload.value - tokens / without.value
    return Rate(2 * moments / 1e9 / added, "GB/s", f"{with_offload.source} against {without.source} ({model} bench, "
                f"{2 * moments / 1e9:.1f} GB of moments out and in, {added:.3f} s added per step)")


def link_gbps(group: int, nvlink: Rate, internode_gbps: float) -> float:
    return nvlink.value if group <= GPUS_PER_NODE else min(nvlink.value, internode_gbps)


def step_time(arch, glm5_arch, counts, layout: Layout, work: Workload, comm: CommVolume, rates: Rates) -> StepTime:
    tokens = work.seq_len // layout.cp
    seqs = sequences_per_rank(layout, work)
    attention, moe, dense, used = compute_parts(arch, glm5_arch, counts, work.model, layout.fp8, work.seq_len,
                                                layout.cp, seqs, rates, work.sample_tokens)
    ep_rate = rates.ep_dispatch_gbps(work.model, tokens)
    nvlink = rates.nvlink_collective_gbps(work.model, tokens)
    overhead = unmodelled_per_token_layer(glm5_arch, layout.fp8, rates)
    unmodelled = seqs * tokens * counts.n_layers * overhead.value
    per_param = rates.per_parameter_seconds()
    per_parameter = counts.total / (layout.fsdp * layout.cp) * per_param.value
    recompute = 0.0 if layout.ac == "none" else (attention + moe + dense) / 3
    compute = attention + moe + dense + recompute + per_parameter + unmodelled
    ep_gbps = ep_rate.value if layout.ep <= GPUS_PER_NODE else min(ep_rate.value, work.internode_gbps)
    ep = comm.ep_all_to_all / (ep_gbps * 1e9)
    cp = comm.cp_gather / (link_gbps(layout.cp, nvlink, work.internode_gbps) * 1e9)
    fsdp_gbps = link_gbps(layout.fsdp * layout.cp, nvlink, work.internode_gbps)
    fsdp = (comm.fsdp_all_gather + comm.fsdp_reduce_scatter) / (fsdp_gbps * 1e9)
    replicas = comm.replica_all_reduce / (work.internode_gbps * 1e9)
    # the moments' copies out and back per step, at the rate measured for titan_ext's offload (or --host-gbps)
    moments = 2 * counts.total / (layout.fsdp * layout.cp) * FP32
    host = Rate(work.host_gbps, "GB/s", "--host-gbps") if work.host_gbps else host_copy_gbps(rates)
    optimizer_offload = 2 * moments / (host.value * 1e9) if work.optim_offload else 0.0
    source = {
        **{k: str(v) for k, v in used.items()}, "unmodelled_per_token_layer": str(overhead),
        "per_parameter": str(per_param),
        "ep_dispatch_gbps": str(ep_rate), "nvlink_collective_gbps": str(nvlink),
        "internode_gbps": f"{work.internode_gbps:g} GB/s  [--internode-gbps: assumed, no multi-node run here]",
    }
    if work.optim_offload:
        source["host_gbps"] = str(host)
    for p in rates.dsa_points():
        source[f"attention_{p.tokens}"] = f"{p.ms}; {p.indexer_ms}; {p.dense_ms}"
    return StepTime(attention=attention, moe=moe, dense=dense, recompute=recompute, per_parameter=per_parameter,
                    unmodelled=unmodelled,
                    ep_all_to_all=ep, cp_gather=cp, fsdp_exposed=max(0.0, fsdp - compute) + replicas,
                    optimizer_offload=optimizer_offload,
                    sequences_per_rank=seqs, rates=source)
