"""GLM-5: MLA with DeepSeek Sparse Attention (lightning indexer) and 256 routed experts."""

from dataclasses import replace

from ..arch import MLAMoEArch

FLAVORS: dict[str, MLAMoEArch] = {
    "full": MLAMoEArch(
        hf_architecture="GlmMoeDsaForCausalLM",
        vocab_size=154880,
        dim=6144,
        n_layers=78,
        n_dense_layers=3,
        dense_hidden_dim=12288,
        n_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_experts=256,
        moe_hidden_dim=2048,
        num_shared_experts=1,
        top_k=8,
        route_scale=2.5,
        max_seq_len=202752,
        norm_eps=1e-5,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
    ),
    # Indexer top-k 8: sequences of 32+ tokens already exercise sparse selection.
    "tiny": MLAMoEArch(
        hf_architecture="GlmMoeDsaForCausalLM",
        vocab_size=512,
        dim=128,
        n_layers=3,
        n_dense_layers=1,
        dense_hidden_dim=256,
        n_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=32,
        moe_hidden_dim=32,
        num_shared_experts=1,
        top_k=4,
        route_scale=2.5,
        max_seq_len=4096,
        norm_eps=1e-5,
        index_n_heads=8,
        index_head_dim=128,  # vLLM's indexer-key cache stores keys in blocks of 128 (one fp32 scale each)
        index_topk=8,
    ),
}

# Full width, four layers (one dense, three MoE), 16 experts, as kimi_k2's "bench": one H200 holds
# it with fp32 master weights and AdamW state, for the long-context benchmark (benchmarks/long_context.py).
FLAVORS["bench"] = replace(FLAVORS["full"], n_layers=4, n_dense_layers=1, num_experts=16)
