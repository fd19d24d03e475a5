"""Block-fp8 weights as Kimi-K2's and GLM-5's published checkpoints store them: the one definition.

A linear weight [m, n] is stored as fp8 e4m3 values plus a float32 ``<name>_scale_inv`` of shape
[ceil(m/128), ceil(n/128)]: one scale per 128x128 block, edge blocks (a shape that 128 does not
divide) included. Reading: ``w = w_fp8.float() * scale_inv`` over each block. Writing follows
vLLM's own block quantizer (``per_block_cast_to_fp8``), so a replica given our bytes holds what
it would have made itself: amax of the block in fp32, floored at 1e-4 (an all-zero block still
gets a finite scale), ``scale_inv = amax / 448``, ``w_fp8 = e4m3(w * (1 / scale_inv))`` rounded
to nearest even, saturated at +-448.

One quantizer, two implementations that agree bit for bit: a Triton kernel on CUDA (one program
per block; divisions rounded as IEEE does, not Triton's fast approximate ``/``) and torch
elsewhere. Both take [m, n] or a stack [e, m, n] (a layer's grouped experts in one call), and
both read the format's numbers from ``block_fp8_format``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .block_fp8_format import AMAX_FLOOR, DEFAULT_BLOCK, FP8, FP8_MAX, SCALE_SUFFIX, scale_shape

__all__ = ["AMAX_FLOOR", "DEFAULT_BLOCK", "FP8", "FP8_MAX", "SCALE_SUFFIX", "BlockFp8Config", "BlockFp8Error",
           "check_scale", "dequantize", "expand_scale", "quantize", "quantize_torch", "scale_shape"]

# Published checkpoints keep these 2-D weights in bf16: the router (vLLM builds it unquantized)
# and GLM-5's indexer head weights (fused with wk in bf16 by vLLM's loader).
_NEVER_QUANTIZED = re.compile(r"\.mlp\.gate\.weight$|\.indexer\.weights_proj\.weight$")


class BlockFp8Error(ValueError):
    """A block-fp8 checkpoint or tensor that cannot be read or written as such (names the tensor)."""


@dataclass(frozen=True)
class BlockFp8Config:
    """The ``quantization_config`` of a block-fp8 checkpoint (``quant_method: fp8`` with ``weight_block_size``)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "BlockFp8Config | None":
        """None for an unquantized config; BlockFp8Error for a quantization this module does not read."""
        q = cfg.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise BlockFp8Error(f"quantization_config.quant_method {method!r} is not supported (only block-wise 'fp8')")
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise BlockFp8Error(f"quantization_config has weight_block_size {block!r}: only block-wise fp8 "
                                "([rows, cols]) is supported, not per-tensor fp8")
        if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
            raise BlockFp8Error(f"quantization_config {q} is not e4m3 weights with dynamic activations")
        return cls(block=(int(block[0]), int(block[1])),
                   modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out

    def quantizes(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """Whether the published layout stores this HF tensor in block fp8: the decoder layers'
        2-D linear weights, except the router, the indexer head weights and `modules_to_not_convert`."""
        return (len(shape) == 2 and hf_name.startswith("model.layers.") and hf_name.endswith(".weight")
                and not _NEVER_QUANTIZED.search(hf_name)
                and not any(m in hf_name for m in self.modules_to_not_convert))


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, name: str = "weight"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale_inv float32) of `w` ([m, n] or [e, m, n]), on `w`'s device.

    A non-finite weight is refused (its block's scale would be inf or NaN)."""
    if w.dim() not in (2, 3):
        raise BlockFp8Error(f"{name}: block-fp8 quantizes [m, n] or [e, m, n] tensors, got shape {tuple(w.shape)}")
    if w.is_cuda:
        from .block_fp8_triton import quantize_cuda

        q, s = quantize_cuda(w, block)
    else:
        q, s = quantize_torch(w, block)
    if not torch.isfinite(s).all():
        raise BlockFp8Error(f"{name}: non-finite values in the weight, cannot quantize it")
    return q, s


def quantize_torch(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation (CPU, and the reference the Triton kernel is tested against)."""
    *lead, m, n = w.shape
    bm, bn = block
    rows, cols = scale_shape(w.shape, block)[-2:]
    # zero padding never raises a block's amax; NaN becomes inf so that it is caught as non-finite
    x = torch.nn.functional.pad(w.float(), (0, cols * bn - n, 0, rows * bm - m))
    blocks = x.view(*lead, rows, bm, cols, bn)
    amax = blocks.abs().nan_to_num(nan=float("inf")).amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR)
    # a tensor divisor: on CUDA torch turns division by a Python number into multiplication by
    # its reciprocal, which rounds differently (seen on the H200: 62% of scales one ulp off)
    scale_inv = amax / amax.new_full((), FP8_MAX)
    scaled = blocks * (1.0 / scale_inv)[..., :, None, :, None]
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(*lead, rows * bm, cols * bn)[..., :m, :n].contiguous()
    return q, scale_inv


def expand_scale(scale_inv: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK
                 ) -> torch.Tensor:
    """The per-element scale of a weight of `shape`: each block's scale over its (possibly cut) block."""
    m, n = shape[-2:]
    return scale_inv.repeat_interleave(block[0], -2)[..., :m, :].repeat_interleave(block[1], -1)[..., :n]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w_fp8.float() * scale_inv`` per block (the reference every checkpoint reader uses), cast to `dtype`.

    Block row by block row into the result, so that loading a checkpoint holds one full-size
    float32 tensor per weight rather than three (the widened weight, the expanded scale, the product)."""
    m, n = q.shape[-2:]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    col_scale = scale_inv.float().repeat_interleave(block[1], -1)[..., :n]  # [..., row blocks, n]
    for i in range(col_scale.shape[-2]):
        rows = slice(i * block[0], min(m, (i + 1) * block[0]))
        torch.mul(q[..., rows, :].float(), col_scale[..., i : i + 1, :], out=out[..., rows, :])
    return out.to(dtype)


def check_scale(name: str, weight_shape: tuple[int, ...], scale_inv: torch.Tensor,
                block: tuple[int, int] = DEFAULT_BLOCK) -> None:
    """Refuse a scale tensor that cannot belong to `name`: wrong shape or dtype, or a scale that is
    not a positive finite number (a corrupted tensor would dequantize to garbage silently)."""
    scale_name = name + SCALE_SUFFIX
    want = scale_shape(weight_shape, block)
    if tuple(scale_inv.shape) != want:
        raise BlockFp8Error(f"{scale_name}: shape {tuple(scale_inv.shape)}, but weight {tuple(weight_shape)} "
                            f"with {block[0]}x{block[1]} blocks needs {want}")
    if scale_inv.dtype != torch.float32:
        raise BlockFp8Error(f"{scale_name}: dtype {scale_inv.dtype}, expected float32")
    bad = ~(torch.isfinite(scale_inv) & (scale_inv > 0))
    if bad.any():
        raise BlockFp8Error(f"{scale_name}: {int(bad.sum())} of {scale_inv.numel()} block scales are not "
                            "positive finite numbers (corrupted checkpoint?)")


__all__ = ["AMAX_FLOOR", "BlockFp8Config", "BlockFp8Error", "DEFAULT_BLOCK", "FP8", "FP8_MAX", "SCALE_SUFFIX",
           "check_scale", "dequantize", "expand_scale", "quantize", "quantize_torch", "scale_shape"]
