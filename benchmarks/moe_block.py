"""titan_ext's MoE block and DSA attention on one GPU: forward+backward speed, side by side.

MoE block: the MoE layer of our Kimi-K2 / GLM-5 full configs (hidden 7168 / 6144, expert
dim 2048, top-8, one shared expert, sigmoid router with bias) with the local expert count of
EP=8 (48 / 32 experts), built by titan_ext's builder with the lean local dispatcher
(`titan_ext.models.experts.LeanTokenDispatcher`). Measured in one run, on the same routed
rows: the grouped-GEMM expert FFN alone (`torch._grouped_mm` SwiGLU fwd+bwd, the roofline),
the block in bf16 (eager and compiled), with and without router replay, TorchTitan's stock
dispatcher for comparison, and the block in fp8: titan_ext's fp8 experts
(`titan_ext.models.fp8_experts.to_fp8`: every routed and shared expert GEMM in fp8 with
row-wise scales, eager), and for comparison torchao's (rowwise fp8 grouped GEMMs for the
experts, tensorwise Float8Linear for the shared expert; torch.compile). FLOPs count every
matmul the block does (gate, routed experts, shared expert), 3x the forward for fwd+bwd.
fp8 numerics: loss mean(out^2) and every gradient against bf16 on the same inputs/weights.

DSA: GLM-5's attention layer (titan_ext's DSAAttention, sparse implementation: the Triton
kernels of glm5/sparse_mla_triton.py on CUDA, "impl" in each entry) forward+backward at 32k
and 128k tokens against TorchTitan's dense MLA attention (causal SDPA) at
the same length; time and peak memory.

    python benchmarks/moe_block.py --out benchmarks/results/moe_block_h200.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import traceback
from contextlib import nullcontext

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import titan_ext  # noqa: E402,F401  (applies patches/ before torchtitan is imported)
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.builder import build_model_config  # noqa: E402
from titan_ext.models.fp8_experts import (  # noqa: E402
    _rows_mm, _wgrad_mm, drop_cached_weights, fp8_swiglu, quantise_weights, to_fp8)
from titan_ext.replay import replay_routing  # noqa: E402

LOCAL_EXPERTS = {"kimi_k2": 48, "glm5": 32}  # 384 / 8 and 256 / 8
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def timed(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over iters runs, after warmup runs (CUDA events)."""
    return timed_interleaved([fn], iters, warmup)[0]


def timed_interleaved(fns, iters: int, warmup: int) -> list[float]:
    """Median milliseconds of each fn, run in turn round after round.

    The H200's clocks drift by a few percent between seconds-apart measurements of the same
    GEMMs; interleaving exposes the cases compared with each other (roofline, replay off/on)
    to the same drift.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
    return [statistics.median(ts) for ts in times]


def build_moe(model: str, dev, pad_multiple: int = 1, stock_dispatcher: bool = False):
    arch = dataclasses.replace(get_arch(model, "full"), num_experts=LOCAL_EXPERTS[model], n_layers=2, n_dense_layers=1)
    cfg = build_model_config(arch)
    moe_cfg = next(layer for layer in cfg.layers if layer.moe is not None).moe
    d = moe_cfg.routed_experts.token_dispatcher  # titan_ext's builder: LeanTokenDispatcher
    if stock_dispatcher:
        moe_cfg.routed_experts.token_dispatcher = AllToAllTokenDispatcher.Config(num_experts=d.num_experts, top_k=d.top_k)
    else:
        d.pad_multiple = pad_multiple
    with torch.device(dev):
        moe = moe_cfg.build()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, 0.02 if "gate" not in name else 0.05)
        moe.expert_bias_E.zero_()
        for p in moe.parameters():  # bf16 compute, as under FSDP2 mixed precision; buffers stay fp32
            p.data = p.data.to(torch.bfloat16)
    return moe.train(), arch


def block_flops(arch, tokens: int) -> dict:
    d, f, k, e = arch.dim, arch.moe_hidden_dim, arch.top_k, arch.num_experts
    routed = 3 * (2 * 3 * tokens * k * d * f)
    shared = 3 * (2 * 3 * tokens * d * f * arch.num_shared_experts)
    gate = 3 * (2 * tokens * d * e)
    return {"routed": routed, "shared": shared, "gate": gate, "total": routed + shared + gate}



def to_torchao_fp8(moe):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization.quant_api import quantize_

    quantize_(moe, config=Float8TrainingOpConfig(), filter_fn=lambda m, _fqn: isinstance(m, GroupedExperts))
    convert_to_float8_training(moe.shared_experts, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return moe


def zero_grads(m):
    for p in m.parameters():
        p.grad = None


def compile_block(moe):
    moe.routed_experts.compile()
    moe.shared_experts.compile()


def grouped_ffn_roofline(arch, counts_E, dev, fp8: bool):
    """A step running the expert SwiGLU FFN alone (fwd+bwd) on the routed rows `counts_E` describe:
    bf16 `torch._grouped_mm`, or (fp8) titan_ext's fp8 expert FFN."""
    d, f = arch.dim, arch.moe_hidden_dim
    e = counts_E.numel()
    gmm = lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)  # noqa: E731
    if fp8:  # groups padded to 16 rows, as the fp8 block pads them
        counts_E = (counts_E + 15) // 16 * 16
    counts = counts_E.tolist()
    rows = int(counts_E.sum())
    offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    w1 = (torch.randn(e, f, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    w3 = (torch.randn(e, f, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    w2 = (torch.randn(e, d, f, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    gy = torch.randn(rows, d, device=dev, dtype=torch.bfloat16, generator=g)

    def step():
        for t in (x, w1, w2, w3):
            t.grad = None
        if fp8:  # titan_ext's fp8 FFN, weights quantised every step
            fp8_swiglu(x, w1, w3, w2, counts, quantise_weights(w1, w3, w2)).backward(gy)
            return
        h = F.silu(gmm(x, w1.transpose(-2, -1), offs)) * gmm(x, w3.transpose(-2, -1), offs)
        gmm(h, w2.transpose(-2, -1), offs).backward(gy)

    return step


def moe_cases(model: str, tokens_list, dev, res: dict, deadline: float, iters: int, fp8: bool = True):
    bf16, arch = build_moe(model, dev)
    fp8_model = torchao_model = None
    for tokens in tokens_list:
        fl = block_flops(arch, tokens)
        g = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        gy = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            _, own_ids, _ = bf16.router(x, bf16.expert_bias_E)
            counts = torch.bincount(own_ids.reshape(-1), minlength=LOCAL_EXPERTS[model])
            replay_ids = own_ids.clone()
            flip = torch.rand(tokens, device=dev, generator=g) < 0.05  # 5% of tokens routed differently
            replay_ids[0, flip] = (replay_ids[0, flip] + 1) % LOCAL_EXPERTS[model]
            replay_ids = replay_ids.unsqueeze(2)  # [B, S, moe layers, K]
        n_iters = iters * max(1, 65536 // tokens)  # short steps: more of them, for a stable median
        roof8 = None
        if fp8:
            try:
                roof8_ms = timed(grouped_ffn_roofline(arch, counts, dev, fp8=True), iters, 2)
                roof8 = fl["routed"] / roof8_ms / 1e9
                log(f"{model} T={tokens} expert FFN fp8 (titan_ext): {roof8_ms:.2f} ms {roof8:.1f} TFLOP/s")
            except Exception:
                log("fp8 grouped FFN failed:\n" + traceback.format_exc(limit=3))

        def run_block(m, replay, requantise=False):
            def step():
                if requantise:  # as after an optimizer step: the fp8 weights are made again
                    drop_cached_weights(m)
                zero_grads(m)
                x.grad = None
                with replay_routing(m, replay_ids) if replay else nullcontext():
                    m(x).backward(gy)
            return step

        def add(dtype, replay, ms, variant, **extra):
            tf = fl["total"] / ms / 1e9
            res["cases"].append({
                "model": model, "tokens": tokens, "dtype": dtype, "replay": replay, "variant": variant,
                "ms": round(ms, 3), "tflops": round(tf, 1), "roofline_tflops": round(roof, 1),
                "fraction_of_roofline": round(tf / roof, 3),
                "fp8_grouped_ffn_tflops": round(roof8, 1) if roof8 else None,
                "flops": fl, "routed_rows": tokens * arch.top_k, **extra,
            })
            log(f"{model} T={tokens} {dtype} replay={replay} {variant}: {ms:.2f} ms {tf:.1f} TFLOP/s "
                f"({tf / roof:.1%} of roofline)")
            write(res)

        # the roofline and the eager block with replay off and on, interleaved (same clock drift)
        roof_ms, *eager_ms = timed_interleaved(
            [grouped_ffn_roofline(arch, counts, dev, fp8=False), run_block(bf16, False), run_block(bf16, True)],
            n_iters, 2)
        torch.cuda.empty_cache()
        roof = fl["routed"] / roof_ms / 1e9
        log(f"{model} T={tokens} roofline grouped FFN bf16: {roof_ms:.2f} ms {roof:.1f} TFLOP/s")
        for replay, ms in zip((False, True), eager_ms):
            add("bf16", replay, ms, "eager")
        if tokens == max(tokens_list):
            stock, _ = build_moe(model, dev, stock_dispatcher=True)
            add("bf16", False, timed(run_block(stock, False), iters, 2), "eager, torchtitan stock dispatcher")
            del stock
        torch.cuda.empty_cache()

        if fp8:
            try:
                if fp8_model is None:
                    fp8_model, _ = build_moe(model, dev)
                    fp8_model.load_state_dict(bf16.state_dict())
                    to_fp8(fp8_model)
                    num = fp8_numerics(bf16, fp8_model, x)
                    res.setdefault("fp8_numerics", {})[model] = num
                    log(f"{model} fp8 vs bf16 numerics: {json.dumps(num)}")
                # the bf16 block again, interleaved with fp8, for the speedup under the same clocks
                bf_ms, *fp_ms = timed_interleaved(
                    [run_block(bf16, False), run_block(fp8_model, False, requantise=True),
                     run_block(fp8_model, True, requantise=True), run_block(fp8_model, False)], n_iters, 2)
                for (replay, variant), ms in zip(((False, "eager"), (True, "eager"), (False, "eager, weights cached")),
                                                 fp_ms):
                    add("fp8", replay, ms, variant, bf16_ms_same_rounds=round(bf_ms, 3),
                        speedup_vs_bf16=round(bf_ms / ms, 3))
            except Exception:
                log("fp8 block failed:\n" + traceback.format_exc())
                res["errors"].append(f"{model} T={tokens} fp8: {traceback.format_exc(limit=2)}")
        torch.cuda.empty_cache()
        if fp8 and time.time() < deadline:
            try:
                if torchao_model is None:
                    torchao_model, _ = build_moe(model, dev, pad_multiple=16)
                    torchao_model.load_state_dict(bf16.state_dict())
                    to_torchao_fp8(torchao_model)
                    compile_block(torchao_model)
                add("fp8", False, timed(run_block(torchao_model, False), n_iters, 3), "torchao, compiled")
            except Exception:
                log("torchao fp8 block failed:\n" + traceback.format_exc())
                res["errors"].append(f"{model} T={tokens} torchao fp8: {traceback.format_exc(limit=2)}")
        torch.cuda.empty_cache()
        if time.time() < deadline:
            try:
                cbf = copy.deepcopy(bf16)
                compile_block(cbf)
                for replay, ms in zip((False, True), timed_interleaved(
                        [run_block(cbf, False), run_block(cbf, True)], n_iters, 3)):
                    add("bf16", replay, ms, "compiled")
                del cbf
            except Exception:
                log("bf16 compiled failed:\n" + traceback.format_exc())
                res["errors"].append(f"{model} T={tokens} bf16 compiled: {traceback.format_exc(limit=2)}")
        del x, gy
        torch.cuda.empty_cache()
    del bf16, fp8_model, torchao_model
    torch.cuda.empty_cache()


def fp8_probe(model: str, tokens: int, dev, iters: int) -> dict:
    """Can an fp8 routed-expert FFN reach 1.5x of bf16? Each GEMM of the SwiGLU FFN, fwd/dgrad/wgrad.

    bf16 `torch._grouped_mm` against fp8 `torch._scaled_grouped_mm` on pre-quantised operands
    (row-wise scales; for the 2-D x 2-D weight gradient per-expert column scales on one side,
    the other side's row scales folded into them), on balanced routed rows (each expert's
    group a multiple of 128); w1 and w3 as one [2F, D] GEMM; and the same GEMMs as one dense
    `torch._scaled_mm` per expert (what the fp8 block runs). Also the quantisation passes a
    step makes (titan_ext.models.fp8_quant), the shared expert's GEMM (`torch._scaled_mm`
    row-wise), and each fp8 GEMM's error against bf16 (which checks the scale layouts).
    """
    from titan_ext.models.fp8_quant import (
        quant_cols_t, quant_rows, swiglu_bwd_quant_rows, swiglu_quant_rows, transpose_groups)

    arch = get_arch(model, "full")
    d, f, e = arch.dim, arch.moe_hidden_dim, LOCAL_EXPERTS[model]
    per = (tokens * arch.top_k // e + 127) // 128 * 128  # aligned groups: the transposed layout = the grouped one
    rows = per * e
    ends = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * per
    counts = [per] * e
    g = torch.Generator(device=dev).manual_seed(2)
    rnd = lambda *s, std=1.0: (torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * std)  # noqa: E731
    # routed rows as the fp8 block makes them: x[src] and g[src] (dy = s * g[src]) for tokens x and output gradient g
    src = torch.randint(0, tokens, (e, per), device=dev, generator=g).sort(dim=1).values.reshape(-1)
    score = torch.rand(rows, device=dev, generator=g)
    x_t, g_t = rnd(tokens, d), rnd(tokens, d)
    x, dyu = x_t[src], g_t[src]
    dy = (dyu.float() * score[:, None]).to(torch.bfloat16)
    h, g13 = rnd(rows, f), rnd(rows, 2 * f)
    w13, w2 = rnd(e, 2 * f, d, std=0.02), rnd(e, d, f, std=0.02)
    w1f, w3f = w13[:, :f].reshape(e * f, d), w13[:, f:].reshape(e * f, d)  # as separate weights
    gmm, sgmm = torch._grouped_mm, torch._scaled_grouped_mm
    bf = {
        "fwd13": lambda: gmm(x, w13.transpose(-2, -1), offs=ends),
        "fwd2": lambda: gmm(h, w2.transpose(-2, -1), offs=ends),
        "dgrad2": lambda: gmm(dyu, w2, offs=ends),
        "dgrad13": lambda: gmm(g13, w13, offs=ends),
        "wgrad2": lambda: gmm(dy.t(), hs, offs=ends),
        "wgrad13": lambda: gmm(dg13.t(), x, offs=ends),
    }
    xt, gt = quant_rows(x_t, colmax=False), quant_rows(g_t, colmax=False)  # tokens
    xg, gg = (transpose_groups(t.q, counts, src, t.scale) for t in (xt, gt))  # their routed rows
    hmul = gg.scale * score  # dW2 = sum_r gq[r]^T (h[r] score[r] s_g[r])
    dg13, dg8, h_colmax = swiglu_bwd_quant_rows(h, g13, xg.scale, hmul, score)  # h standing in for dh
    hs = swiglu_quant_rows(g13)  # h of g13, for W2's gradient
    hs = (hs.q.float() * hs.scale[:, None]).to(torch.bfloat16)
    w13r, w2r = quant_rows(w1f, interleave=(w3f, f)), quant_rows(w2.view(-1, f))
    r = {"x": (xg.q, xg.scale), "h": quant_rows(h)[:2], "dy": (gg.q, gg.scale), "g13": quant_rows(g13)[:2],
         "w13": w13r[:2], "w2": w2r[:2]}
    quant = {  # every quantisation pass one routed fp8 step makes
        "rows x (tokens)": lambda: quant_rows(x_t, colmax=False),
        "gather x (rows + transposed)": lambda: transpose_groups(xt.q, counts, src, xt.scale),
        "rows h (swiglu)": lambda: swiglu_quant_rows(g13),
        "rows g (tokens)": lambda: quant_rows(g_t, colmax=False),
        "gather g (rows + transposed)": lambda: transpose_groups(gt.q, counts, src, gt.scale),
        "rows dg13 (swiglu bwd, score dot, h maxima)": lambda: swiglu_bwd_quant_rows(h, g13, xg.scale, hmul, score),
        "cols h (swiglu, scaled)": lambda: quant_cols_t(g13, counts, h_colmax, mul_R=hmul, swiglu=True),
        "cols dg13 (scaled)": lambda: quant_cols_t(dg13, counts, dg8.colmax, mul_R=xg.scale),
        "rows w13": lambda: quant_rows(w1f, interleave=(w3f, f)), "rows w2": lambda: quant_rows(w2.view(-1, f)),
        "cols w13": lambda: quant_cols_t(w1f, [2 * f] * e, w13r.colmax, stacked=True, interleave=(w3f, f)),
        "cols w2": lambda: quant_cols_t(w2.view(-1, f), [d] * e, w2r.colmax, stacked=True),
    }
    q = dict(r)
    q["cols h"] = quant["cols h (swiglu, scaled)"]()
    q["cols g13"] = quant["cols dg13 (scaled)"]()
    q["cols w13"], q["cols w2"] = quant["cols w13"](), quant["cols w2"]()
    x8, sx = q["x"]
    w13_8, sw13 = q["w13"]
    w2_8, sw2 = q["w2"]
    w2t8, sw2t = q["cols w2"]
    w13t8, sw13t = q["cols w13"]
    ones = lambda n: torch.ones(e * n, device=dev)  # noqa: E731  (transpose_groups' operand: scale 1)
    fp = {
        "fwd13": lambda: sgmm(x8, w13_8.view(e, 2 * f, d).transpose(-2, -1), sx, sw13.view(e, 2 * f), offs=ends,
                              out_dtype=torch.bfloat16),
        "fwd2": lambda: sgmm(q["h"][0], w2_8.view(e, d, f).transpose(-2, -1), q["h"][1], sw2.view(e, d),
                             offs=ends, out_dtype=torch.bfloat16),
        "dgrad2": lambda: sgmm(q["dy"][0], w2t8.transpose(-2, -1), q["dy"][1], sw2t, offs=ends,
                               out_dtype=torch.bfloat16),
        "dgrad13": lambda: sgmm(q["g13"][0], w13t8.transpose(-2, -1), q["g13"][1], sw13t, offs=ends,
                                out_dtype=torch.bfloat16),
        "wgrad2": lambda: sgmm(gg.t, q["cols h"][0].t(), ones(d), q["cols h"][1].reshape(-1), offs=ends,
                               out_dtype=torch.bfloat16),
        "wgrad13": lambda: sgmm(q["cols g13"][0], xg.t.t(), q["cols g13"][1].reshape(-1), ones(d), offs=ends,
                                out_dtype=torch.bfloat16),
    }
    # the same GEMMs as one dense torch._scaled_mm per expert, as the fp8 block runs them
    w13t8, w2t8 = w13t8.view(e, d, 2 * f), w2t8.view(e, f, d)
    bf16 = torch.bfloat16

    def wgrad(a_t, b_t, m, n):
        out = torch.empty(e, m, n, dtype=bf16, device=dev)
        _wgrad_mm(a_t, b_t, counts, out)
        return out

    per_expert = {
        "fwd13": lambda: _rows_mm(x8, sx, (w13_8.view(e, 2 * f, d), sw13.view(e, 2 * f)), counts, bf16),
        "fwd2": lambda: _rows_mm(q["h"][0], q["h"][1], (w2_8.view(e, d, f), sw2.view(e, d)), counts, bf16),
        "dgrad2": lambda: _rows_mm(q["dy"][0], q["dy"][1], (w2t8, sw2t), counts, bf16),
        "dgrad13": lambda: _rows_mm(q["g13"][0], q["g13"][1], (w13t8, sw13t), counts, bf16),
        "wgrad2": lambda: wgrad((gg.t, None), q["cols h"], d, f),
        "wgrad13": lambda: wgrad(q["cols g13"], (xg.t, None), 2 * f, d),
    }
    out = {"rows": rows, "gemm": {}, "quant_ms": {}}
    for name in bf:
        entry = {"flops": None}
        try:
            ref = bf[name]().float()
            for key, fn in (("rel_err", fp[name]), ("per_expert_rel_err", per_expert[name])):
                entry[key] = round(((fn().float() - ref).norm() / ref.norm()).item(), 4)
            del ref
            ms_b, ms_f, ms_p = timed_interleaved([bf[name], fp[name], per_expert[name]], iters, 2)
            fl = 2 * rows * (2 * f if "13" in name else f) * d
            entry.update(flops=fl, bf16_ms=round(ms_b, 3), fp8_ms=round(ms_f, 3), per_expert_fp8_ms=round(ms_p, 3),
                         bf16_tflops=round(fl / ms_b / 1e9, 1), fp8_tflops=round(fl / ms_f / 1e9, 1),
                         per_expert_fp8_tflops=round(fl / ms_p / 1e9, 1))
        except Exception:
            entry["error"] = traceback.format_exc(limit=2)
        out["gemm"][name] = entry
        log(f"probe {model} T={tokens} {name}: {entry}")
    for name, fn in quant.items():
        out["quant_ms"][name] = round(timed(fn, iters, 1), 3)
    log(f"probe {model} T={tokens} quant ms: {out['quant_ms']}")
    # the shared expert's up-projection (w1|w3 as one [2F, D] weight) on the block's tokens
    xs, ws = rnd(tokens, d), rnd(2 * f, d, std=0.02)
    (xs8, sxs, _, _), (ws8, sws, _, _) = quant_rows(xs), quant_rows(ws)
    ms_b, ms_f = timed_interleaved([lambda: xs @ ws.t(), lambda: torch._scaled_mm(
        xs8, ws8.t(), sxs[:, None], sws[None, :], out_dtype=torch.bfloat16)], iters, 2)
    fl = 2 * tokens * 2 * f * d
    out["shared_fwd13"] = {"bf16_tflops": round(fl / ms_b / 1e9, 1), "fp8_tflops": round(fl / ms_f / 1e9, 1)}
    ok = [v for v in out["gemm"].values() if "fp8_ms" in v]
    if len(ok) == len(bf):
        gb, gf, gp = (sum(v[k] for v in ok) for k in ("bf16_ms", "fp8_ms", "per_expert_fp8_ms"))
        qms = sum(out["quant_ms"].values())
        out["routed_gemms"] = {"bf16_ms": round(gb, 2), "fp8_ms": round(gf, 2), "fp8_plus_quant_ms": round(gf + qms, 2),
                               "speedup_gemms_only": round(gb / gf, 3), "speedup_with_quant": round(gb / (gf + qms), 3),
                               "per_expert_fp8_ms": round(gp, 2), "per_expert_speedup_gemms_only": round(gb / gp, 3),
                               "per_expert_speedup_with_quant": round(gb / (gp + qms), 3)}
    log(f"probe {model} T={tokens}: {out.get('routed_gemms')} shared {out['shared_fwd13']}")
    return out


def fp8_numerics(bf16, fp8_model, x_full) -> dict:
    """Loss mean(out^2) and gradients of fp8 vs bf16, same weights, same 8192 tokens."""
    x0 = x_full[:, :8192].detach()
    out = {}
    grads = {}
    for name, m in (("bf16", bf16), ("fp8", fp8_model)):
        zero_grads(m)
        xi = x0.clone().requires_grad_(True)
        y = m(xi)
        loss = y.float().pow(2).mean()
        loss.backward()
        out[name] = loss.item()
        grads[name] = {"x": xi.grad.float()}
        for pn, p in m.named_parameters():
            if p.grad is not None:
                g = p.grad
                g = g._data if hasattr(g, "_data") else g
                grads[name][pn] = g.float()
        zero_grads(m)
    rel = {}
    for pn, gb in grads["bf16"].items():
        gf = grads["fp8"].get(pn)
        if gf is not None:
            rel[pn] = round(((gf - gb).norm() / gb.norm()).item(), 5)
    return {"loss_bf16": out["bf16"], "loss_fp8": out["fp8"],
            "loss_rel_diff": abs(out["fp8"] - out["bf16"]) / abs(out["bf16"]), "grad_rel_l2": rel}


def dsa_cases(tokens_list, dev, res, iters):
    from torchtitan.models.deepseek_v3.model import Attention

    arch = get_arch("glm5", "full")
    for tokens in tokens_list:
        for heads in (arch.n_heads, arch.n_heads // 2):
            entry = {"tokens": tokens, "heads": heads}
            try:
                a2 = dataclasses.replace(arch, n_heads=heads, n_layers=1, n_dense_layers=1)
                attn_cfg = build_model_config(a2).layers[0].attention
                dense_cfg = Attention.Config(**{f.name: getattr(attn_cfg, f.name) for f in dataclasses.fields(Attention.Config)})
                with torch.device(dev):
                    dsa = attn_cfg.build()
                torch.manual_seed(0)
                with torch.no_grad():
                    for p in dsa.parameters():
                        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
                dsa = dsa.to(torch.bfloat16)
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
                with torch.no_grad():
                    idx = dsa.indexer(x, dsa.q_norm(dsa.wq_a(x)), dsa.rope, None)
                    torch.cuda.synchronize()
                    entry["indexer_ms"] = round(timed(lambda: dsa.indexer(x, dsa.q_norm(dsa.wq_a(x)), dsa.rope, None), 1, 0), 1)
                    del idx
                log(f"DSA ({entry['impl']}) T={tokens} heads={heads}: {entry['ms']} ms, peak {entry['gib']} GiB (indexer {entry['indexer_ms']} ms)")
                del dsa
                torch.cuda.empty_cache()
                with torch.device(dev):
                    dense = dense_cfg.build()
                with torch.no_grad():
                    for p in dense.parameters():
                        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
                dense = dense.to(torch.bfloat16)
                torch.cuda.reset_peak_memory_stats()
                entry["dense_ms"] = round(timed(step(dense), 1 if tokens > 65536 else iters, 1), 1)
                entry["dense_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                entry["speedup_vs_dense"] = round(entry["dense_ms"] / entry["ms"], 2)
                log(f"dense MLA T={tokens} heads={heads}: {entry['dense_ms']} ms, peak {entry['dense_gib']} GiB")
                del dense, x, gy
                torch.cuda.empty_cache()
                res["dsa"].append(entry)
                write(res)
                break
            except torch.OutOfMemoryError:
                log(f"DSA T={tokens} heads={heads}: out of memory, fewer heads")
                torch.cuda.empty_cache()
                entry["error"] = "out of memory"
                if heads == arch.n_heads // 2:
                    res["dsa"].append(entry)
            except Exception:
                log("DSA failed:\n" + traceback.format_exc())
                entry["error"] = traceback.format_exc(limit=2)
                res["dsa"].append(entry)
                torch.cuda.empty_cache()
                break
    write(res)


OUT_PATH = [None]


def write(res):
    with open(OUT_PATH[0], "w") as f:
        json.dump(res, f, indent=1)


def _previous(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/moe_block_h200.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--models", nargs="+", default=["kimi_k2", "glm5"])
    ap.add_argument("--dsa-tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480, help="no new compiled case after this many seconds")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-dsa", action="store_true")
    ap.add_argument("--skip-fp8", action="store_true", help="bf16 MoE cases only")
    ap.add_argument("--fp8-probe", action="store_true",
                    help="only time each routed-expert GEMM in bf16 vs fp8 and the quantisation passes (key fp8_probe)")
    args = ap.parse_args()
    OUT_PATH[0] = args.out
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    # One code object (RoutedExperts.forward) is compiled per model x shape x dtype: 8 here.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
        "setup": {
            "local_experts": LOCAL_EXPERTS, "expert_dim": 2048, "top_k": 8, "shared_experts": 1,
            "dispatcher": "titan_ext LeanTokenDispatcher (EP=1 path)", "dtype": "bf16 params and activations",
            "fp8": "titan_ext.models.fp8_experts.to_fp8: routed + shared expert SwiGLU GEMMs (fwd, dgrad, wgrad) in "
                   "fp8 e4m3 with row-wise scales, one torch._scaled_mm per expert, Triton quantisation kernels; the "
                   "routed fp8 function spans dispatch and combine (routed rows quantised from the tokens, their "
                   "gradient from the block's output gradient); eager; weights quantised every step unless the "
                   "variant says 'weights cached'",
            "fp8_torchao": "torchao rowwise fp8 grouped GEMMs (Float8TrainingOpConfig) + tensorwise Float8Linear "
                           "shared expert, torch.compile on routed_experts and shared_experts",
            "replay": "ReplayRouter with recorded ids (5% of tokens differ from own top-k)",
            "roofline": "torch._grouped_mm SwiGLU expert FFN alone, fwd+bwd, same routed rows per expert",
            "flops": "gate + routed experts + shared expert matmuls, fwd+bwd = 3x fwd",
            "fp8_tolerance": {"loss_rel_diff": 0.01, "grad_rel_l2": 0.1},
            "fp8_grouped_ffn_tflops": "titan_ext's fp8 expert FFN alone (fp8_swiglu, weights quantised every step), "
                                      "fwd+bwd, same routed rows as the roofline",
        },
        "cases": [], "dsa": [], "errors": [],
        # expert parallel needs 2+ GPUs: benchmarks/moe_ep.py adds it to the same file
        "ep": _previous(args.out).get("ep"),
        "fp8_probe": _previous(args.out).get("fp8_probe"),  # written by --fp8-probe
    }
    try:
        import torchao

        res["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        res["torchao"] = f"unavailable: {e}"
    deadline = T0 + args.budget_s
    if args.fp8_probe:
        prev = _previous(args.out)
        prev["fp8_probe"] = {"command": res["command"], "device": res["device"], "torch": res["torch"]}
        for model in args.models:
            for tokens in args.tokens:
                prev["fp8_probe"][f"{model} T={tokens}"] = fp8_probe(model, tokens, dev, args.iters)
                res = prev
                write(res)
        return
    if not args.skip_dsa:  # first: bounded, and needs no compilation
        dsa_cases(args.dsa_tokens, dev, res, max(2, args.iters // 2))
    if not args.skip_moe:
        for model in args.models:
            try:
                moe_cases(model, args.tokens, dev, res, deadline, args.iters, fp8=not args.skip_fp8)
            except Exception:
                log("MoE failed:\n" + traceback.format_exc())
                res["errors"].append(f"{model}: {traceback.format_exc(limit=3)}")
                torch.cuda.empty_cache()
    res["wall_s"] = round(time.time() - T0, 1)
    write(res)
    print("\n== summary ==")
    for c in res["cases"]:
        print(f"{c['model']:8s} T={c['tokens']:6d} {c['dtype']:4s} replay={int(c['replay'])} {c['variant']:38s} "
              f"{c['ms']:9.2f} ms {c['tflops']:7.1f} TF/s  roof {c['roofline_tflops']:6.1f} ({c['fraction_of_roofline']:.1%})")
    for d in res["dsa"]:
        print("DSA", d)
    for k, v in res.get("fp8_numerics", {}).items():
        print("fp8 numerics", k, v["loss_rel_diff"], max(v["grad_rel_l2"].values()))
    for e in res["errors"]:
        print("ERROR", e[:400])


if __name__ == "__main__":
    main()
