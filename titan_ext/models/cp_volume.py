"""The size of context parallel's latent gather, in a module that imports nothing.

`context_parallel` (which needs torch) re-exports it; `moerl plan` (rl_loop/plan, which must
answer without importing torch) reads it from here, so the formula has one implementation.
"""

from __future__ import annotations


def latent_gather_bytes(tokens: int, *, kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int = 0,
                        dtype_bytes: int = 2) -> int:
    """Bytes one layer's latent all-gather yields on each rank for a sequence of `tokens`:
    tokens x (kv_lora + rope + indexer key) x dtype bytes (GLM-5 bf16: 704 x 2 x tokens)."""
    return tokens * (kv_lora_rank + qk_rope_head_dim + index_head_dim) * dtype_bytes
