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

`block_fp8`, `shards` and `mtp` write the checkpoint the way Kimi-K2 and GLM-5 are published:
linear weights in block fp8 with `weight_scale_inv` (titan_ext.models.block_fp8; the tiny
shapes leave edge blocks that 128 does not divide), several shards with an index file, and
GLM-5's MTP layer (one extra decoder layer with its enorm/hnorm/eh_proj/shared_head, which
titan_ext skips).
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
    block_fp8: bool = False,
    shards: int = 1,
    mtp: bool = False,
    max_position_embeddings: int | None = None,
    chat_template: str | None = None,
    warm_start_steps: int = 0,
) -> Path:
    """Write config, safetensors and tokenizer for `arch` to `out_dir` (idempotent for equal arguments).

    Every weight matrix is drawn from N(0, init_scale); a tensor whose name
    contains a key of `init_scales` (parameters and buffers, any rank) is drawn
    from N(0, that value) instead (the first matching key wins).
    `max_position_embeddings` overrides the context the config declares (tests of a
    checkpoint's context limit). `chat_template` (a `chat_templates` name) gives the tokenizer that
    family's special tokens and chat template, and trains its merges on conversations in that format;
    `warm_start_steps` then trains the model on demonstrations in that format (`warm_start.py`)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")
    if warm_start_steps and (chat_template is None or block_fp8 or shards != 1 or mtp):
        raise ValueError("warm_start_steps needs a chat_template and the plain layout (no block_fp8, shards, mtp)")
    out = Path(out_dir)
    stamp = out / "moerl_tiny.json"
    meta = {"arch": arch, "dtype": dtype, "init_scale": init_scale, "seed": seed}
    if init_scales:
        meta["init_scales"] = dict(init_scales)
    if max_position_embeddings is not None:
        meta["max_position_embeddings"] = max_position_embeddings
    if chat_template is not None:
        meta["chat_template"] = chat_template
    if warm_start_steps:
        meta["warm_start_steps"] = warm_start_steps
    if block_fp8 or shards != 1 or mtp:
        meta.update(block_fp8=block_fp8, shards=shards, mtp=mtp)
    if stamp.exists() and json.loads(stamp.read_text()) == meta:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(arch, dtype)
    config.initializer_range = init_scale
    if max_position_embeddings is not None:
        config.max_position_embeddings = max_position_embeddings
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
    if block_fp8 or shards != 1 or mtp:
        _published_layout(out, block_fp8=block_fp8, shards=shards, mtp=mtp, seed=seed, init_scale=init_scale)
    if chat_template is None:
        train_tokenizer(out)
    else:
        from .chat_templates import get_template, sample_conversations

        tpl = get_template(chat_template)
        train_tokenizer(out, special_tokens=tpl.special_tokens, extra_corpus=tuple(sample_conversations(tpl)),
                        chat_template=tpl.template)
    if warm_start_steps:
        from .warm_start import warm_start

        warm_start(out, steps=warm_start_steps, dtype=dtype, seed=seed)
    stamp.write_text(json.dumps(meta))
    return out


def _published_layout(out: Path, *, block_fp8: bool, shards: int, mtp: bool, seed: int, init_scale: float) -> None:
    """Rewrite `out`'s weights as published checkpoints ship them (see the module docstring)."""
    from safetensors.torch import load_file

    from titan_ext.checkpoint import INDEX_FILE, write_safetensors
    from titan_ext.models.block_fp8 import SCALE_SUFFIX, BlockFp8Config, quantize

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    cfg = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    if mtp:
        sd.update(_mtp_layer(sd, cfg, seed, init_scale))
        cfg["num_nextn_predict_layers"] = 1
    quant = BlockFp8Config() if block_fp8 else None
    items: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if quant is not None and quant.quantizes(name, tuple(t.shape)):
            items[name], items[name + SCALE_SUFFIX] = quantize(t, quant.block, name)
        else:
            items[name] = t
    if quant is not None:
        cfg["quantization_config"] = quant.to_hf()
    for f in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        f.unlink(missing_ok=True)
    sizes = [t.numel() * t.element_size() for t in items.values()]
    # greedy filling to this bound gives at most `shards` shards (each full one holds > total/shards)
    write_safetensors(items.items(), out, sum(sizes) // shards + max(sizes) if shards > 1 else None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _mtp_layer(sd: dict[str, torch.Tensor], cfg: dict, seed: int, init_scale: float) -> dict[str, torch.Tensor]:
    """GLM-5's MTP layer as its checkpoint has it: a decoder layer numbered after the last one
    (here a perturbed copy of the last) plus enorm, hnorm, eh_proj and shared_head.norm."""
    n, dim = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = f"model.layers.{n - 1}."
    gen = torch.Generator().manual_seed(seed + 1)
    out = {f"model.layers.{n}." + k[len(last):]: v + init_scale * torch.randn(v.shape, generator=gen).to(v.dtype)
           for k, v in sd.items() if k.startswith(last)}
    dtype = next(iter(sd.values())).dtype
    prefix = f"model.layers.{n}."
    out.update({prefix + "enorm.weight": torch.ones(dim, dtype=dtype), prefix + "hnorm.weight": torch.ones(dim, dtype=dtype),
                prefix + "shared_head.norm.weight": torch.ones(dim, dtype=dtype),
                prefix + "eh_proj.weight": (init_scale * torch.randn(dim, 2 * dim, generator=gen)).to(dtype)})
    return out
