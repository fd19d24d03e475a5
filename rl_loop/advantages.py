"""Group-relative advantages (GRPO-style): each sample is judged against its siblings.

Samples of one prompt form a group; a sample's advantage is its reward minus the
group mean, optionally divided by the group's standard deviation. Groups whose
rewards are all equal carry no signal and get zero advantage everywhere.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """`rewards` [groups, samples_per_group] -> advantages of the same shape."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centered
