"""The numbers of the block-fp8 format that both quantizers share (``block_fp8``'s torch one and
``block_fp8_triton``'s kernel): the fp8 type and range, the amax floor, the block and the scale's shape.

A module of its own so the kernel reads them without importing ``block_fp8``, which picks the
kernel on CUDA: each builds on this one, neither on the other.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    *lead, m, n = shape
    return (*lead, -(-m // block[0]), -(-n // block[1]))
