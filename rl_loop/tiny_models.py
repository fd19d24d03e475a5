"""Tiny, randomly initialised HF checkpoints built from real architecture configs.

Tests, benchmarks and the embedded default run on CPU and may not download
anything, so every checkpoint is made here: the architecture from a titan_ext
flavor (Kimi-K2, GLM-5) or a small Qwen3-MoE, weights from transformers' own
initialiser with a fixed seed, and a byte-level BPE tokenizer trained on a
built-in corpus. `init_scale` rescales the weights: at the default 0.02 routing is
near uniform and expert choices barely matter; 0.1-0.3 makes them matter.
`init_scales` overrides the std for tensors whose name contains a key (for
example a gentler attention, or a non-zero `e_score_correction_bias`, which is
otherwise left at zero).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from titan_ext.tiny_assets import VOCAB_SIZE, train_tokenizer

ARCHS = ("qwen3_moe", "kimi_k2", "glm5")


def hf_config(arch: str, dtype: str):
    import transformers

    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype=dtype,
        )
    from titan_ext.models import get_arch

    cfg = get_arch(arch, "tiny").to_hf_config()
    cfg.update(bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype=dtype)
    cls = transformers.CONFIG_MAPPING[cfg.pop("model_type")]
    return cls(**{k: v for k, v in cfg.items() if k != "architectures"})


def make_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    init_scale: float = 0.02,
    seed: int = 0,
    init_scales: Mapping[str, float] | None = None,
) -> Path:
    """Write config, safetensors and tokenizer for `arch` to `out_dir` (idempotent for equal arguments).

    Every weight matrix is drawn from N(0, init_scale); a tensor whose name
    contains a key of `init_scales` (parameters and buffers, any rank) is drawn
    from N(0, that value) instead (the first matching key wins)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")
    out = Path(out_dir)
    stamp = out / "moerl_tiny.json"
    meta = {"arch": arch, "dtype": dtype, "init_scale": init_scale, "seed": seed}
    if init_scales:
        meta["init_scales"] = dict(init_scales)
    if stamp.exists() and json.loads(stamp.read_text()) == meta:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(arch, dtype)
    config.initializer_range = init_scale
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    overrides = dict(init_scales or {})
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            std = next((v for k, v in overrides.items() if k in name), None)
            if std is not None:
                p.normal_(0.0, std)
            elif name.endswith("e_score_correction_bias") or p.dim() < 2 or not p.is_floating_point():
                continue
            elif isinstance(p, torch.nn.Parameter):
                p.normal_(0.0, init_scale)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    train_tokenizer(out)
    stamp.write_text(json.dumps(meta))
    return out
