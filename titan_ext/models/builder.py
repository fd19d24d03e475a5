"""Turn an `MLAMoEArch` into a TorchTitan `DeepSeekV3Model.Config`.

We reuse TorchTitan's DeepSeek-V3 building blocks (MLA attention, MoE with the
aux-loss-free bias, token dispatchers, parallelize function) and change only what
differs:
- experts that compute in their input dtype (`experts.NativeDtypeGroupedExperts`),
  so an fp32 model matches transformers to rounding;
- the lean token dispatcher (`experts.LeanTokenDispatcher`: gathers with gather duals
  instead of sorting scatters, one all-to-all each way under EP); `configure_moe`
  switches a built config to another dispatcher or to fp8 experts (`titan_ext.options`);
- maskless causal SDPA as the default inner attention, because FlexAttention has no
  CPU backward;
- MLA attention that runs context parallel over gathered latents (`mla.MLAttention`), and the
  DSA attention for models with a lightning indexer (`dsa.DSAAttention`);
- the replaying router (`titan_ext.replay`), identical to TorchTitan's until ids are replayed;
- norm epsilons as the checkpoint has them.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch.nn as nn
from torchtitan.config import derive
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import build_mla_moe_layers
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.common.param_init import depth_scaled_std

from .arch import MLAMoEArch
from .glm5.dsa import DSAAttention, LightningIndexer
from .mla import MLAttention
from ..replay import replay_router
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from .deepep import DeepEPV1TokenDispatcher
from .experts import LeanTokenDispatcher, NativeDtypeGroupedExperts
from .fp8_experts import Fp8FeedForward, Fp8RoutedExperts

AttnBackend = Literal["sdpa", "flex"]
Dispatcher = Literal["lean", "torchtitan", "deepep"]

DISPATCHERS: dict[str, type] = {
    "lean": LeanTokenDispatcher.Config,
    "torchtitan": AllToAllTokenDispatcher.Config,  # TorchTitan's own, as stock
    "deepep": DeepEPV1TokenDispatcher.Config,
}

# HF's MLA builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps,
# not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def _trunc_normal(std: float) -> dict:
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def build_model_config(
    arch: MLAMoEArch,
    *,
    attn_backend: AttnBackend = "sdpa",
    init_std: float = 0.02,
) -> DeepSeekV3Model.Config:
    """The TorchTitan model config for `arch`."""
    rope = ComplexRoPE.Config(
        dim=arch.qk_rope_head_dim,
        max_seq_len=arch.max_seq_len,
        theta=arch.rope_theta,
        scaling="yarn" if arch.yarn else "none",
        rope_factor=arch.yarn.factor if arch.yarn else 1.0,
        beta_fast=arch.yarn.beta_fast if arch.yarn else 32.0,
        beta_slow=arch.yarn.beta_slow if arch.yarn else 1.0,
        original_seq_len=arch.yarn.original_max_position_embeddings if arch.yarn else 4096,
    )
    grouped = arch.n_group > 1
    layers = build_mla_moe_layers(
        n_layers=arch.n_layers,
        n_dense_layers=arch.n_dense_layers,
        dim=arch.dim,
        n_heads=arch.n_heads,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.qk_nope_head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        mscale=arch.yarn.mscale_all_dim if arch.yarn else 1.0,
        dense_hidden_dim=arch.dense_hidden_dim,
        moe_hidden_dim=arch.moe_hidden_dim,
        num_experts=arch.num_experts,
        num_shared_experts=arch.num_shared_experts,
        router_top_k=arch.top_k,
        router_score_func="sigmoid",
        router_num_expert_groups=arch.n_group if grouped else None,
        router_num_limited_groups=arch.topk_group if grouped else None,
        router_route_scale=arch.route_scale,
        router_route_norm=arch.route_norm,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=_trunc_normal(init_std),
        norm_init={"weight": nn.init.ones_},
        depth_init=lambda layer_id: _trunc_normal(depth_scaled_std(init_std, layer_id)),
        depth_experts_init=lambda layer_id: {
            "w1_EFD": partial(nn.init.trunc_normal_, std=init_std),
            "w2_EDF": partial(nn.init.trunc_normal_, std=depth_scaled_std(init_std, layer_id)),
            "w3_EFD": partial(nn.init.trunc_normal_, std=depth_scaled_std(init_std, layer_id)),
        },
        rope=rope,
    )
    for layer in layers:
        attn = layer.attention = derive(layer.attention, MLAttention.Config)
        attn.q_norm.eps = _LATENT_NORM_EPS
        attn.kv_norm.eps = _LATENT_NORM_EPS
        layer.attention_norm.eps = arch.norm_eps
        layer.ffn_norm.eps = arch.norm_eps
        if attn_backend == "sdpa":
            attn.inner_attention = ScaledDotProductAttention.Config()
        else:
            attn.inner_attention = FlexAttention.Config()
        if arch.has_indexer:
            layer.attention = _with_indexer(attn, arch, init_std)
        if layer.moe is not None:
            layer.moe.router = replay_router(layer.moe.router)
            experts = layer.moe.routed_experts
            experts.inner_experts = derive(experts.inner_experts, NativeDtypeGroupedExperts.Config)
            experts.token_dispatcher = derive(experts.token_dispatcher, LeanTokenDispatcher.Config)
    return DeepSeekV3Model.Config(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=arch.dim,
            param_init={"weight": partial(nn.init.normal_, std=init_std)},
        ),
        norm=RMSNorm.Config(normalized_shape=arch.dim, eps=arch.norm_eps, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=arch.dim, out_features=arch.vocab_size, param_init=_trunc_normal(init_std)),
        layers=layers,
        mtp_layers=[],
    )


def check_moe_options(dispatcher: str, fp8: bool) -> None:
    """ValueError (one line) unless `dispatcher` and `fp8` can build a model together.

    fp8 experts lay out their own expert rows from the lean route (`fp8_experts`), so they
    need a lean-family dispatcher (lean or deepep), not TorchTitan's. The one statement of
    the rule: `configure_moe` (torchtitan train) and `moerl rl`'s config check call it.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r}; choose one of {', '.join(DISPATCHERS)}")
    if fp8 and dispatcher == "torchtitan":
        raise ValueError("fp8 experts need the lean or deepep dispatcher, not torchtitan's")


def configure_moe(model_cfg, *, dispatcher: Dispatcher = "lean", fp8: bool = False) -> None:
    """Switch every MoE layer of a built model config to `dispatcher`, and to fp8 experts when `fp8`
    (`check_moe_options` first)."""
    check_moe_options(dispatcher, fp8)
    for layer in model_cfg.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        routed = moe.routed_experts
        routed.token_dispatcher = derive(routed.token_dispatcher, DISPATCHERS[dispatcher])
        if fp8:
            moe.routed_experts = derive(routed, Fp8RoutedExperts.Config)
            if moe.shared_experts is not None:
                moe.shared_experts = derive(moe.shared_experts, Fp8FeedForward.Config)


def configure_indexer(model_cfg, *, fp8_ranking: bool) -> None:
    """Make every DSA layer's indexer of a built model config rank keys in fp8 as vLLM's does
    (`LightningIndexer.Config.fp8_ranking`), or in the model's dtype."""
    for layer in model_cfg.layers:
        indexer = getattr(layer.attention, "indexer", None)
        if indexer is not None:
            indexer.fp8_ranking = fp8_ranking


def _with_indexer(attn, arch: MLAMoEArch, init_std: float) -> DSAAttention.Config:
    if arch.q_lora_rank == 0:
        raise ValueError("the DSA indexer reads the q latent: q_lora_rank must be > 0")
    return derive(
        attn,
        DSAAttention.Config,
        indexer=LightningIndexer.Config(
            dim=arch.dim,
            q_lora_rank=arch.q_lora_rank,
            n_heads=arch.index_n_heads,
            head_dim=arch.index_head_dim,
            rope_dim=arch.qk_rope_head_dim,
            topk=arch.index_topk,
            linear_init=_trunc_normal(init_std),
        ),
    )
