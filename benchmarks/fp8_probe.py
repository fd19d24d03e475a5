"""Where the fp8 MoE block's time goes: each routed-expert GEMM in bf16 and fp8, and each quantisation pass.

For the MoE layer of the full Kimi-K2 / GLM-5 configs at the EP=8 local expert count, on one
GPU; see ``probe``. Writes the key ``fp8_probe`` of the results file (other keys kept):

    python -m benchmarks.fp8_probe --out benchmarks/results/moe_block_h200.json
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.fp8_experts import _rows_mm, _wgrad_mm  # noqa: E402

from .gpu_bench import (  # noqa: E402
    LOCAL_EXPERTS, Clock, ResultsFile, cuda_device, moe_arg_parser, run_info, timed, timed_interleaved)


def probe(model: str, tokens: int, dev, iters: int, clock: Clock) -> dict:
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
        clock.log(f"probe {model} T={tokens} {name}: {entry}")
    for name, fn in quant.items():
        out["quant_ms"][name] = round(timed(fn, iters, 1), 3)
    clock.log(f"probe {model} T={tokens} quant ms: {out['quant_ms']}")
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
    clock.log(f"probe {model} T={tokens}: {out.get('routed_gemms')} shared {out['shared_fwd13']}")
    return out


def main() -> None:
    ap = moe_arg_parser(__doc__, iters=5)
    args = ap.parse_args()
    clock, results = Clock(), ResultsFile(Path(args.out))
    dev = cuda_device()
    out = run_info(__spec__.name)
    for model in args.models:
        for tokens in args.tokens:
            out[f"{model} T={tokens}"] = probe(model, tokens, dev, args.iters, clock)
            results.update({"fp8_probe": out})


if __name__ == "__main__":
    main()
