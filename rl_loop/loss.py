"""The RL loss: token-level importance-sampled policy gradient with mismatch masking.

Tokens were sampled by the inference engine, so the gradient is importance
weighted by r = p_train / p_infer per token. Where the two engines disagree too
much (r outside [1/max_ratio, max_ratio]) the token is dropped from the loss
instead of clipped: such tokens are numerics or routing artefacts, not signal.
The same pass measures the mismatch: the k3 estimator exp(d) - d - 1 with
d = logp_train - logp_infer over completion tokens, and the fraction of extreme
tokens. This is the one definition of the loss; the trainer calls it, on whole sequences or, to
never hold [tokens, vocabulary] logits, chunk by chunk (`rl_loop.chunked_loss`): every term
is per token, so a chunk's share is `surrogate` over its tokens and the metrics are taken
once over the assembled log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    max_ratio: float = 2.0
    """Tokens with p_train/p_infer above this or below its inverse are masked out."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    num_tokens: int
    k3_mean: float
    k3_max: float
    extreme_frac: float
    masked_frac: float
    entropy_mean: float | None = None
    """Mean entropy of the policy over completion tokens, when the caller measured it."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under `logits` ([B, S, V], [B, S]) in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (with its gradient) and the policy's entropy at each position (fp32, no gradient),
    from one log-softmax over the vocabulary."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def mismatch_k3(logp_train: torch.Tensor, logp_infer: torch.Tensor) -> torch.Tensor:
    """Per-token k3 KL estimate exp(d) - d - 1, d = logp_train - logp_infer (>= 0)."""
    d = logp_train - logp_infer
    return torch.expm1(d) - d


def extreme_tokens(ratio: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Where `ratio` = p_train / p_infer is outside [1 / max_ratio, max_ratio] (no gradient)."""
    with torch.no_grad():
        return (ratio > config.max_ratio) | (ratio < 1.0 / config.max_ratio)


def surrogate(logp_train: torch.Tensor, logp_infer: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config: LossConfig) -> torch.Tensor:
    """The loss's numerator: -sum of ratio x advantage over the completion tokens that are not extreme."""
    ratio = torch.exp(logp_train - logp_infer)
    keep = mask.bool() & ~extreme_tokens(ratio, config)
    return -(ratio * advantages * keep).sum()


def policy_loss(
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    total_tokens: int | None = None,
) -> LossOutput:
    """All arguments are [B, S] (advantages broadcast per sequence); `mask` marks completion tokens.

    The loss is summed over kept tokens and divided by the number of completion
    tokens, so masking a token removes its contribution without rescaling others.
    That number is `total_tokens` when given: a rank holding part of a batch (its
    data-parallel rows, its context-parallel positions) passes the whole batch's
    count, so the ranks' losses and gradients sum to the whole batch's; such a
    part may hold no completion token at all. The metrics are over this part.
    """
    if not (logp_train.shape == logp_infer.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: logp_train {tuple(logp_train.shape)}, logp_infer {tuple(logp_infer.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    mask = mask.bool()
    n = int(mask.sum())
    denominator = n if total_tokens is None else total_tokens
    if denominator == 0:
        raise ValueError("no completion tokens in the batch")
    loss = surrogate(logp_train, logp_infer, advantages, mask, config) / denominator
    with torch.no_grad():
        extreme = extreme_tokens(torch.exp(logp_train - logp_infer), config)
        keep = mask & ~extreme
        k3 = mismatch_k3(logp_train.detach(), logp_infer)[mask]
    per_token = max(n, 1)  # n == 0: every metric is 0 (k3 >= 0), and weighs 0 in a token-weighted mean
    return LossOutput(
        loss=loss,
        num_tokens=n,
        k3_mean=k3.sum().item() / per_token,
        k3_max=k3.max().item() if n else 0.0,
        extreme_frac=(extreme & mask).sum().item() / per_token,
        masked_frac=(mask & ~keep).sum().item() / per_token,
    )
