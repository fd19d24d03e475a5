"""GLM-5's DSA attention layer on one GPU against dense MLA attention: forward+backward time and peak memory.

titan_ext's DSAAttention (sparse implementation: the Triton kernels of glm5/sparse_mla_triton.py
on CUDA, "impl" in each entry) at 32k, 64k and 128k tokens against TorchTitan's dense MLA attention
(causal SDPA) at the same length; with all 64 heads, or half of them where 64 run out of
memory. Writes the keys ``dsa`` (one entry per length) and ``dsa_run`` of the results file
(other keys kept), and ``dsa_kernels``: the sparse attention's Triton kernels alone, forward and
backward, in every launch setting of their lists (`sparse_mla_triton.CONFIGS`; the first that fits
is what the layer runs), on random causal selections of top-k keys:

    python -m benchmarks.dsa_layer --out benchmarks/results/moe_block_h200.json

Each entry's ``tflop`` counts the layer's work (``layer_flops``), with T tokens, H heads, latent
width C = kv_lora_rank + rope dim (576) of which V = kv_lora_rank (512) are values, and
n_sel = sum over positions p of min(topk, p + 1) selected (query, key) pairs:
- sparse attention in the absorbed form, fwd+bwd = 3 x fwd: 3 * 2 * H * (C + V) * n_sel;
- the indexer's scores, forward only (it is frozen): 2 * Hi * Di * T (T + 1) / 2;
- the projections with gradients (wq_a, wq_b, wkv_a, the absorbed W_uk / W_uv, wo), fwd+bwd =
  3 x fwd: 6 * T * their weights; the indexer's (wq_b, wk, weights_proj), forward only: 2 * T * weights.
GLM-5 at 131,072 tokens: 111 + 70 + 130 + 2.5 = 314 TFLOP. ``tflops`` divides it by the measured
time and ``fraction_of_dense_bf16`` by the dense bf16 matmul rate measured in the same run
(``dsa_run.dense_bf16_tflops``).
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

from .gpu_bench import (  # noqa: E402
    RESULTS, Clock, ResultsFile, cuda_device, dense_bf16_tflops, run_info, timed, zero_grads,
)


def layer_flops(arch, tokens: int, heads: int) -> dict[str, float]:
    """FLOPs of one DSA layer's forward+backward over `tokens` (the module docstring's formula)."""
    latent, values = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    topk = arch.index_topk
    n_sel = topk * tokens - topk * (topk - 1) // 2 if tokens >= topk else tokens * (tokens + 1) // 2
    qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    trained = (arch.dim * arch.q_lora_rank + arch.q_lora_rank * heads * qk_head
               + arch.dim * latent + heads * arch.qk_nope_head_dim * arch.kv_lora_rank
               + heads * arch.kv_lora_rank * arch.v_head_dim + heads * arch.v_head_dim * arch.dim)
    frozen = (arch.q_lora_rank * arch.index_n_heads * arch.index_head_dim + arch.dim * arch.index_head_dim
              + arch.dim * arch.index_n_heads)
    parts = {
        "attention": 3 * 2 * heads * (latent + values) * n_sel,
        "indexer_scores": 2 * arch.index_n_heads * arch.index_head_dim * tokens * (tokens + 1) / 2,
        "projections": 6 * tokens * trained + 2 * tokens * frozen,
    }
    return {**parts, "total": sum(parts.values())}


def kernel_sweep(tokens: int, arch, dev, clock: Clock) -> list[dict]:
    """Milliseconds and TFLOP/s of the sparse attention kernels per launch setting at `tokens`:
    the forward for each forward setting; the backward (both passes) for each pass-1 setting with
    the first pass-2 one, and for each pass-2 setting with the first pass-1 one. One query per
    token, all heads, `index_topk` keys drawn uniformly among the earlier ones (the first
    `index_topk` queries take keys 0..topk-1, the later of which they mask)."""
    from titan_ext.models.glm5 import sparse_mla_triton as smt

    heads, topk = arch.n_heads, arch.index_topk
    latent, values = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    g = torch.Generator(device=dev).manual_seed(tokens)
    q = torch.randn(1, tokens, heads, latent, device=dev, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, tokens, latent, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.arange(tokens, device=dev)
    idx = (torch.rand(tokens, topk, device=dev, generator=g) * (pos[:, None] + 1)).long()
    idx[:topk] = torch.arange(topk, device=dev)
    idx = idx[None]
    scale = latent**-0.5
    fwd_flop = layer_flops(arch, tokens, heads)["attention"] / 3  # the formula counts fwd+bwd as 3 x fwd
    out, lse = smt.sparse_mla_fwd(q, kv, idx, scale, values)
    dout = torch.randn(out.shape, device=dev, dtype=torch.bfloat16, generator=g)
    first_bwd, first_dkv = smt.BWD_CONFIGS[0], smt.DKV_CONFIGS[0]
    cases = [("fwd", c, fwd_flop, lambda c=c: smt.sparse_mla_fwd(q, kv, idx, scale, values, config=c))
             for c in smt.FWD_CONFIGS]
    cases += [("bwd", {"pass1": c, "pass2": first_dkv}, 2 * fwd_flop,
               lambda c=c: smt.sparse_mla_bwd(q, kv, idx, out, lse, dout, scale, config=c, dkv_config=first_dkv))
              for c in smt.BWD_CONFIGS]
    cases += [("bwd", {"pass1": first_bwd, "pass2": c}, 2 * fwd_flop,
               lambda c=c: smt.sparse_mla_bwd(q, kv, idx, out, lse, dout, scale, config=first_bwd, dkv_config=c))
              for c in smt.DKV_CONFIGS[1:]]
    rows = []
    for kind, config, flop, fn in cases:
        row = {"tokens": tokens, "kernel": kind, "config": config}
        try:
            ms = timed(fn, 3, 1)
            row.update(ms=round(ms, 1), tflops=round(flop / ms / 1e9, 1))
        except Exception as e:  # a setting that does not fit this GPU's shared memory
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        clock.log(f"sparse attention {kind} T={tokens} {config}: {row.get('ms', row.get('error'))}")
        rows.append(row)
    del q, kv, idx, out, lse, dout
    torch.cuda.empty_cache()
    return rows


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
    entry["tflop"] = round(layer_flops(arch, tokens, heads)["total"] / 1e12, 1)
    entry["tflops"] = round(entry["tflop"] / entry["ms"] * 1e3, 1)
    clock.log(f"dense MLA T={tokens} heads={heads}: {entry['dense_ms']} ms, peak {entry['dense_gib']} GiB")
    del dense, x, gy
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--kernel-tokens", type=int, nargs="*", default=[32768, 131072],
                    help="lengths of the kernel sweep (`dsa_kernels`); none to skip it")
    args = ap.parse_args()
    clock, results = Clock(), ResultsFile(Path(args.out))
    dev = cuda_device()
    arch = get_arch("glm5", "full")
    entries: list[dict] = []
    dense = dense_bf16_tflops()
    part = {"dsa": entries, "dsa_run": {**run_info(__spec__.name), "dense_bf16_tflops": round(dense, 1)}}
    for tokens in args.tokens:
        for heads in (arch.n_heads, arch.n_heads // 2):
            entry = {"tokens": tokens, "heads": heads}
            try:
                measure(entry, arch, dev, args.iters, clock)
                entry["fraction_of_dense_bf16"] = round(entry["tflops"] / dense, 3)
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
    if args.kernel_tokens:
        part["dsa_kernels"] = [row for tokens in args.kernel_tokens for row in kernel_sweep(tokens, arch, dev, clock)]
        results.update(part)


if __name__ == "__main__":
    main()
