"""GLM-5's DSA attention layer on one GPU against dense MLA attention: forward+backward time and peak memory.

titan_ext's DSAAttention (sparse implementation: the Triton kernels of glm5/sparse_mla_triton.py
on CUDA, "impl" in each entry) at 32k and 128k tokens against TorchTitan's dense MLA attention
(causal SDPA) at the same length; with all 64 heads, or half of them where 64 run out of
memory. Writes the keys ``dsa`` (one entry per length) and ``dsa_run`` of the results file
(other keys kept):

    python -m benchmarks.dsa_layer --out benchmarks/results/moe_block_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback
from pathlib import Path

import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.builder import build_model_config  # noqa: E402

from .gpu_bench import RESULTS, Clock, ResultsFile, cuda_device, run_info, timed, zero_grads  # noqa: E402


def _init_bf16(m: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return m.to(torch.bfloat16)


def measure(entry: dict, arch, dev, iters: int, clock: Clock) -> None:
    """Fill ``entry`` (tokens, heads) with the sparse layer's and the dense layer's figures,
    as far as they get (an out-of-memory error leaves the ones measured before it)."""
    from torchtitan.models.deepseek_v3.model import Attention

    tokens, heads = entry["tokens"], entry["heads"]
    a2 = dataclasses.replace(arch, n_heads=heads, n_layers=1, n_dense_layers=1)
    attn_cfg = build_model_config(a2).layers[0].attention
    dense_cfg = Attention.Config(**{f.name: getattr(attn_cfg, f.name) for f in dataclasses.fields(Attention.Config)})
    with torch.device(dev):
        dsa = attn_cfg.build()
    torch.manual_seed(0)
    dsa = _init_bf16(dsa)
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    gy = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g)

    def step(m):
        def f():
            zero_grads(m)
            x.grad = None
            m(x, None, None).backward(gy)
        return f

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    entry["ms"] = round(timed(step(dsa), iters, 1), 1)
    entry["impl"] = dsa.sparse_impl  # "triton" kernels or the chunked "torch" path
    entry["gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    entry["gib_above_inputs"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    with torch.no_grad():  # the indexer alone, projections included, ranking in bf16 and as vLLM's fp8
        for key, fp8 in (("indexer_ms", False), ("indexer_fp8_ms", True)):
            dsa.indexer.fp8_ranking = fp8
            entry[key] = round(timed(lambda: dsa.indexer(x, dsa.q_norm(dsa.wq_a(x)), dsa.rope, None), 1, 1), 1)
    clock.log(f"DSA ({entry['impl']}) T={tokens} heads={heads}: {entry['ms']} ms, peak {entry['gib']} GiB "
              f"(indexer {entry['indexer_ms']} ms, fp8 ranking {entry['indexer_fp8_ms']} ms)")
    del dsa
    torch.cuda.empty_cache()
    with torch.device(dev):
        dense = _init_bf16(dense_cfg.build())
    torch.cuda.reset_peak_memory_stats()
    entry["dense_ms"] = round(timed(step(dense), 1 if tokens > 65536 else iters, 1), 1)
    entry["dense_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    entry["speedup_vs_dense"] = round(entry["dense_ms"] / entry["ms"], 2)
    clock.log(f"dense MLA T={tokens} heads={heads}: {entry['dense_ms']} ms, peak {entry['dense_gib']} GiB")
    del dense, x, gy
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args()
    clock, results = Clock(), ResultsFile(Path(args.out))
    dev = cuda_device()
    arch = get_arch("glm5", "full")
    entries: list[dict] = []
    part = {"dsa": entries, "dsa_run": run_info(__spec__.name)}
    for tokens in args.tokens:
        for heads in (arch.n_heads, arch.n_heads // 2):
            entry = {"tokens": tokens, "heads": heads}
            try:
                measure(entry, arch, dev, args.iters, clock)
                entries.append(entry)
                results.update(part)
                break
            except torch.OutOfMemoryError:
                clock.log(f"DSA T={tokens} heads={heads}: out of memory, fewer heads")
                torch.cuda.empty_cache()
                entry["error"] = "out of memory"
                if heads == arch.n_heads // 2:
                    entries.append(entry)
            except Exception:
                clock.log("DSA failed:\n" + traceback.format_exc())
                entry["error"] = traceback.format_exc(limit=2)
                entries.append(entry)
                torch.cuda.empty_cache()
                break
    results.update(part)


if __name__ == "__main__":
    main()
