"""Block-fp8 export on the trainer's GPU: the quantization kernel against the device's copy bandwidth.

Weight sync to an fp8 replica quantizes every routed and shared expert weight per 128x128 block
each step (`titan_ext.models.block_fp8`, Triton kernel on CUDA). The kernel is memory-bound: it
reads each bf16 element once (2 B) and writes one fp8 byte plus a float32 scale per block, so its
figure of merit is bytes moved per second against what a plain device-to-device copy moves
(read + write) in the same run. The weights are one full Kimi-K2 MoE layer as titan_ext holds
them: routed experts w1/w3 [384, 2048, 7168] and w2 [384, 7168, 2048], plus the shared expert
(one [2048, 7168] w1/w3 and [7168, 2048] w2), in bf16 (33.9 GB).

Also checks that the kernel's output equals the torch quantizer on the CPU (the definition the
tests check) bit for bit, fp8 bytes and scales, on `--check-experts` experts of each routed
tensor and on the shared expert: Triton's interpreter cannot show this (its fp32 -> e4m3 cast
differs), the GPU's round-to-nearest-even cast should.

    python -m benchmarks.fp8_export --out benchmarks/results/fp8_export_h200.json
    python -m benchmarks.fp8_export --experts 2 --dim 384 --hidden 256 --out /tmp/x.json   # CPU check

Imports `titan_ext.models`, hence TorchTitan: on a bare GPU machine install the checkout first
(scripts/gpu_check.sh does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from titan_ext.models import block_fp8 as bf


def timed(fn, device: torch.device, repeats: int) -> float:
    """Best-of-`repeats` seconds of fn() after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--dim", type=int, default=7168)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth buffer")
    ap.add_argument("--check-experts", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if kernel:
        from titan_ext.models.block_fp8_triton import quantize_cuda as quant
    else:
        quant = bf.quantize_torch
    block = bf.DEFAULT_BLOCK
    e, d, f = args.experts, args.dim, args.hidden
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {
        "routed_w1": (e, f, d), "routed_w3": (e, f, d), "routed_w2": (e, d, f),
        "shared_w1": (f, d), "shared_w3": (f, d), "shared_w2": (d, f),
    }
    results, total_s, total_bytes, checks = {}, 0.0, 0, {}
    for name, shape in weights.items():
        w = (torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
        q, s = quant(w, block)
        nbytes = w.numel() * w.element_size() + q.numel() + s.numel() * 4
        sec = timed(lambda: quant(w, block), device, args.repeats)
        results[name] = {"shape": list(shape), "ms": sec * 1e3, "bytes": nbytes, "gbps": nbytes / sec / 1e9}
        total_s += sec
        total_bytes += nbytes
        part = (slice(0, args.check_experts),) if w.dim() == 3 else (slice(None),)
        want_q, want_s = bf.quantize_torch(w[part].cpu(), block)  # the CPU path is the definition tests check
        checks[name] = {
            "fp8_bytes_differing": int((q[part].cpu().view(torch.uint8) != want_q.view(torch.uint8)).sum()),
            "scales_differing": int((s[part].cpu() != want_s).sum()),
            "elements_checked": want_q.numel(),
        }
        del w, q, s, want_q, want_s
        if device.type == "cuda":
            torch.cuda.empty_cache()

    n = int(args.copy_gib * (1 << 30)) // 2
    src = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, args.repeats)
    copy_gbps = 2 * src.numel() * src.element_size() / copy_s / 1e9
    kernel_gbps = total_bytes / total_s / 1e9
    out = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "implementation": "triton kernel" + (" (interpreter)" if device.type != "cuda" else "") if kernel else "torch",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__ if kernel else None,
        "layer": {"experts": e, "dim": d, "hidden": f, "block": list(block),
                  "bf16_bytes": sum(torch.Size(s).numel() * 2 for s in weights.values())},
        "per_tensor": results,
        "kernel_total_ms": total_s * 1e3,
        "kernel_gbps": kernel_gbps,
        "copy_gbps": copy_gbps,
        "kernel_vs_copy": kernel_gbps / copy_gbps,
        "bytes_note": "kernel bytes = bf16 read + fp8 written + float32 scales; copy bytes = read + write",
        "bitwise_vs_torch": checks,
        "bitwise_equal": all(c["fp8_bytes_differing"] == 0 and c["scales_differing"] == 0 for c in checks.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("implementation", "kernel_total_ms", "kernel_gbps", "copy_gbps",
                                          "kernel_vs_copy", "bitwise_equal")}))
    return out


if __name__ == "__main__":
    main()
