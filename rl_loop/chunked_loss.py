"""The RL loss straight from the last hidden states, the LM head applied chunk by chunk.

Whole-sequence logits are [tokens, vocabulary]: 32k local tokens x 163,840 in fp32 is 21 GB,
more than the rest of a long-context step. Every term of the loss is per token, so the
sequence is cut into chunks along its length; each chunk's logits exist only while its
share of the loss (`rl_loop.loss.surrogate`) and its backward run, and the gradients of
the chunks' hidden states are assembled for one backward through the decoder.

The chunk loop is TorchTitan's `ChunkedLossWrapper` (the one `torchtitan train` uses for
cross-entropy with `--titan_ext.loss_chunks`): it keeps an FSDP-sharded LM head gathered
across the chunks and reduce-scatters its gradient once. Here its per-chunk loss is the RL
surrogate; the chunks' log-probabilities and entropies are kept (no gradient, [B, S] each)
so the metrics are `policy_loss`'s, over the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper

from .loss import LossConfig, LossOutput, policy_loss, surrogate, token_logprobs_and_entropy


def chunk_count(local_tokens: int, chunk_tokens: int) -> int:
    """Chunks for a local sequence of `local_tokens` positions, each at most about `chunk_tokens`."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return max(1, math.ceil(local_tokens / chunk_tokens))


class _SurrogateChunks(BaseLoss):
    """One chunk's share of the RL loss: `surrogate` over its tokens / the batch's completion tokens."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        max_ratio: float = LossConfig.max_ratio
        denominator: int = 1

    def __init__(self, config: Config, *, compile_config=None):
        self.config = LossConfig(max_ratio=config.max_ratio)
        self.denominator = config.denominator
        self.logp: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []

    def __call__(self, logits, labels, global_valid_tokens=None, *, logp_infer, advantages, mask):
        logp, entropy = token_logprobs_and_entropy(logits, labels)
        self.logp.append(logp.detach())
        self.entropy.append(entropy)
        return surrogate(logp, logp_infer, advantages, mask, self.config) / self.denominator, {}


def chunked_policy_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor,
                        logp_infer: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        config: LossConfig, total_tokens: int | None, num_chunks: int) -> LossOutput:
    """`policy_loss` of the logits `lm_head(hidden)` ([B, S, D] -> [B, S, V]) without ever holding them:
    `num_chunks` (dividing S) pieces along the sequence. The returned loss's backward runs the decoder's
    backward from the assembled hidden-state gradient (the LM head's is already accumulated)."""
    if hidden.size(1) % num_chunks:
        raise ValueError(f"{num_chunks} loss chunks do not divide the local sequence of {hidden.size(1)} positions")
    mask = mask.bool()
    denominator = int(mask.sum()) if total_tokens is None else total_tokens
    if denominator == 0:
        raise ValueError("no completion tokens in the batch")
    wrapper = ChunkedLossWrapper.Config(
        num_chunks=num_chunks,
        loss_fn=_SurrogateChunks.Config(max_ratio=config.max_ratio, denominator=denominator)).build()
    wrapper.set_lm_head(lm_head)
    loss, _ = wrapper(hidden, targets, None, logp_infer=logp_infer, advantages=advantages.expand_as(mask).float(),
                      mask=mask)
    chunks = wrapper.loss_fn
    logp, entropy = torch.cat(chunks.logp, dim=1), torch.cat(chunks.entropy, dim=1)
    metrics = policy_loss(logp, logp_infer, advantages, mask, config, total_tokens)
    n = max(metrics.num_tokens, 1)
    metrics.loss = loss
    metrics.entropy_mean = (entropy * mask).sum().item() / n
    return metrics
