"""`moerl check-parity`: does a titan_ext port compute what transformers computes?

Loads one HF checkpoint twice, into titan_ext through the state-dict adapter and
into transformers' reference model, feeds both the same tokens in fp32 and
compares logits. This is the check a user runs when porting a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoint import load_hf_checkpoint


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

    def to_dict(self) -> dict:
        return asdict(self)


def check_parity(
    ckpt_dir: str | Path, model: str, *, seq_len: int = 64, batch: int = 2, tolerance: float = 1e-4, seed: int = 0
) -> ParityReport:
    import transformers

    titan_model, arch = load_hf_checkpoint(ckpt_dir, model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
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
    )
