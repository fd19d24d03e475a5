"""What a training step costs per parameter on the GPU, each piece alone, against the HBM's copy rate.

A step's per-parameter work does not grow with its tokens: AdamW's step (TorchTitan's default
`fused` implementation, reading parameter, gradient and both moments and writing three of them:
28 bytes a parameter), FSDP2's copy-in (the fp32 shard cast to the bf16 all-gather input: 6 bytes)
and copy-out (the bf16 reduce-scatter output into the fp32 gradient: 6 bytes). This times each on
the parameter count of `kimi_k2 bench` (5.4e9, in 256 Mi-element tensors), next to a plain fp32
copy that gives the HBM rate a kernel can reach, so each piece's distance from its floor is
stated. `moerl plan` charges fused AdamW and both casts per local parameter
(`rl_loop/plan/rates.py` `per_parameter_seconds`); benchmarks/README.md says how much of a whole
step (`benchmarks.train_step`) they explain.

    python -m benchmarks.param_costs --out benchmarks/results/param_costs_h200.json
"""

from __future__ import annotations

import argparse

import torch

from .gpu_bench import ResultsFile, run_info, timed
from .train_step import ROOT

CHUNK = 1 << 28


def tensors(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    return [torch.empty(s, dtype=dtype, device="cuda") for s in sizes]


def casts(params: list[torch.nn.Parameter], iters: int) -> dict[str, tuple[float, int]]:
    """FSDP2's copy-in and copy-out casts; their bf16 buffers are freed on return, leaving room
    for the moments (and foreach's temporaries)."""
    low = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    return {"copy_in_fp32_to_bf16": (timed(lambda: [lo.copy_(p) for lo, p in zip(low, params)], iters, 2), 6),
            "copy_out_bf16_to_fp32": (timed(lambda: [p.grad.copy_(lo) for lo, p in zip(low, params)], iters, 2), 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/param_costs_h200.json")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    import titan_ext

    titan_ext.activate()  # the trainer's patches, before anything imports TorchTitan
    from rl_loop.plan.model import load_arch, param_counts

    n = param_counts(load_arch("kimi_k2", "bench")).total
    params = [torch.nn.Parameter(t.normal_()) for t in tensors(n, torch.float32)]
    for p in params:
        p.grad = torch.randn_like(p)

    copy_ms = timed(lambda: [p.grad.copy_(p) for p in params], args.iters, 2)
    hbm = 2 * 4 * n / copy_ms / 1e6  # GB/s: 4 bytes a parameter read and written
    measured = casts(params, args.iters)  # name: (ms, bytes moved per parameter)
    for impl in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, **{impl: True})
        measured[f"adamw_{impl}"] = (timed(opt.step, args.iters, 2), 28)
        del opt
        torch.cuda.empty_cache()
    res = {**run_info("benchmarks.param_costs"), "parameters": n, "model": "kimi_k2 bench (fp32 parameters)",
           "fp32_copy_ms": copy_ms, "hbm_copy_gbps": hbm, "pieces": {}}
    for name, (ms, bytes_per_param) in measured.items():
        floor = bytes_per_param * n / hbm / 1e6
        res["pieces"][name] = {"ms": ms, "bytes_per_parameter": bytes_per_param, "floor_ms_at_copy_rate": floor,
                               "over_floor": ms / floor, "ns_per_parameter": ms * 1e6 / n}
        print(name, res["pieces"][name], flush=True)
    ResultsFile(ROOT / args.out).update(res)
    print({k: v for k, v in res.items() if k != "pieces"})


if __name__ == "__main__":
    main()
