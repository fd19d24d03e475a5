"""Peak GPU memory of one forward+backward of titan_ext's MoE block, above its inputs.

The block `benchmarks.moe_block` times (same builder, EP=8 local experts, bf16 parameters, the
lean local dispatcher), in bf16 and with titan_ext's fp8 experts, at each token count: the
peak allocated during one step minus what was allocated before it (parameters, input, output
gradient), after one warm-up step so lazily made state is not counted. The warm-up's weight
gradients are dropped before the measured step, so the peak counts the step's own gradients
(bf16, as the block's parameters) beside its activations. `moerl plan`'s
activation model of the MoE block is tested against these figures. Writes the key
``moe_memory`` of the results file (other keys kept):

    python -m benchmarks.moe_memory --out benchmarks/results/moe_block_h200.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from titan_ext.models.fp8_experts import to_fp8

from .gpu_bench import Clock, ResultsFile, cuda_device, moe_arg_parser, run_info, zero_grads
from .moe_block import block_step, build_moe, routing


def peak_above_inputs(step, m: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes allocated at the peak of `step()` (a forward+backward of `m` on `x`) beyond the
    parameters and inputs allocated when it started."""
    step()
    zero_grads(m)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = moe_arg_parser(__doc__, iters=1)
    args = ap.parse_args()
    clock, results = Clock(), ResultsFile(Path(args.out))
    dev = cuda_device()
    entries: list[dict] = []
    part = {"moe_memory": entries, "moe_memory_run": run_info(__spec__.name)}
    for model in args.models:
        bf16, arch = build_moe(model, dev)
        fp8, _ = build_moe(model, dev)
        fp8.load_state_dict(bf16.state_dict())
        to_fp8(fp8)
        for tokens in args.tokens:
            g = torch.Generator(device=dev).manual_seed(tokens)
            x = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            gy = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g)
            ids = routing(bf16, x, g).replay_ids
            for dtype, m in (("bf16", bf16), ("fp8", fp8)):
                peak = peak_above_inputs(block_step(m, x, gy, ids, replay=False, requantise=dtype == "fp8"), m, x)
                entries.append({"model": model, "tokens": tokens, "dtype": dtype,
                                "local_experts": arch.num_experts, "gib_above_inputs": round(peak / 2**30, 3)})
                clock.log(f"{model} T={tokens} {dtype}: peak {peak / 2**30:.3f} GiB above inputs")
                results.update(part)
            del x, gy, ids
            torch.cuda.empty_cache()
        del bf16, fp8
        torch.cuda.empty_cache()
    results.update(part)


if __name__ == "__main__":
    main()
