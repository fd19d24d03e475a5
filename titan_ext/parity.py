"""`moerl check-parity`: does a titan_ext port compute what transformers computes?

Loads one HF checkpoint twice, into titan_ext through the state-dict adapter and
into transformers' reference model, feeds both the same tokens in fp32 and
compares logits. This is the check a user runs when porting a model.

Block-fp8 checkpoints (Kimi-K2, GLM-5 as published): transformers cannot build its reference
from them here. Its fp8 loader needs `accelerate` (not in the lock) and, on CPU, dequantizes
with a block size derived from the scale grid (rows // scale rows), which is wrong for a weight
whose last block is cut: a [192, 64] weight gets 96-row blocks, a [576, 128] one
(kv_a_proj_with_mqa) is refused as "not divisible". So the reference model is transformers
loading the checkpoint's weights dequantized by the reference formula
(`block_fp8.dequantize`, w_fp8.float() * scale_inv per 128x128 block) into a temporary plain
fp32 checkpoint (`checkpoint.dequantized_copy`); `ParityReport.reference` says which reference ran.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import checkpoint_quantization, dequantized_copy, load_hf_checkpoint

REFERENCE_PLAIN = "transformers on the checkpoint"
REFERENCE_DEQUANTIZED = "transformers on the checkpoint dequantized by the reference formula (fp32)"


@dataclass
class ParityReport:
    model: str
    hf_architecture: str
    seq_len: int
    batch: int
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    max_abs_logit: float
    argmax_agreement: float
    tolerance: float
    passed: bool
    reference: str = REFERENCE_PLAIN

    def to_dict(self) -> dict:
        return asdict(self)


def check_parity(
    ckpt_dir: str | Path, model: str, *, seq_len: int = 64, batch: int = 2, tolerance: float = 1e-4, seed: int = 0
) -> ParityReport:
    titan_model, arch = load_hf_checkpoint(ckpt_dir, model)
    if not 0 < seq_len <= arch.max_seq_len:
        raise ValueError(f"--seq-len {seq_len}: the checkpoint's context is {arch.max_seq_len} tokens "
                         f"(max_position_embeddings in {Path(ckpt_dir) / 'config.json'}); use 1..{arch.max_seq_len}")
    if checkpoint_quantization(ckpt_dir) is None:
        ref, reference = _reference(ckpt_dir), REFERENCE_PLAIN
    else:
        with tempfile.TemporaryDirectory(prefix="moerl-parity-") as tmp:
            ref, reference = _reference(dequantized_copy(ckpt_dir, tmp)), REFERENCE_DEQUANTIZED
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=gen)
    with torch.no_grad():
        ours = titan_model(tokens).float()
        theirs = ref(tokens).logits.float()
    diff = (ours - theirs).abs()
    max_diff = diff.max().item()
    return ParityReport(
        model=model,
        hf_architecture=arch.hf_architecture,
        seq_len=seq_len,
        batch=batch,
        max_abs_logit_diff=max_diff,
        mean_abs_logit_diff=diff.mean().item(),
        max_abs_logit=theirs.abs().max().item(),
        argmax_agreement=(ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        tolerance=tolerance,
        passed=max_diff <= tolerance,
        reference=reference,
    )


def _reference(ckpt_dir: str | Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
