"""titan_ext's MoE block on one GPU: forward+backward speed in bf16 and fp8, against its roofline.

The MoE layer of our Kimi-K2 / GLM-5 full configs (hidden 7168 / 6144, expert dim 2048,
top-8, one shared expert, sigmoid router with bias) with the local expert count of EP=8
(48 / 32 experts), built by titan_ext's builder with the lean local dispatcher
(`titan_ext.models.experts.LeanTokenDispatcher`). Measured in one run, on the same routed
rows: the grouped-GEMM expert FFN alone (`torch._grouped_mm` SwiGLU fwd+bwd, the roofline),
the block in bf16 (eager and compiled), with and without router replay, TorchTitan's stock
dispatcher for comparison, and the block in fp8: titan_ext's fp8 experts
(`titan_ext.models.fp8_experts.to_fp8`: every routed and shared expert GEMM in fp8 with
row-wise scales, eager), and for comparison torchao's (rowwise fp8 grouped GEMMs for the
experts, tensorwise Float8Linear for the shared expert; torch.compile). The cases compared
with each other are timed in alternating rounds (``timed_interleaved``), hence one script.
FLOPs count every matmul the block does (gate, routed experts, shared expert), 3x the
forward for fwd+bwd. fp8 numerics: loss mean(out^2) and every gradient against bf16 on the
same inputs/weights.

Writes its keys of the results file (``cases``, ``fp8_numerics``, ``setup``, ...) and keeps
the others (``dsa``: ``benchmarks.dsa_layer``, ``fp8_probe``: ``benchmarks.fp8_probe``,
``ep``: ``benchmarks.moe_ep``):

    python -m benchmarks.moe_block --out benchmarks/results/moe_block_h200.json
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.builder import build_model_config, configure_moe  # noqa: E402
from titan_ext.models.fp8_experts import drop_cached_weights, fp8_swiglu, quantise_weights, to_fp8  # noqa: E402
from titan_ext.replay import replay_routing  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from .gpu_bench import (  # noqa: E402
    LOCAL_EXPERTS, Clock, ResultsFile, cuda_device, dense_bf16_tflops, moe_arg_parser, run_info, timed, timed_interleaved,
    zero_grads)


def build_moe(model: str, dev, pad_multiple: int = 1, dispatcher: str = "lean", ranks: int = 1,
              flavor: str = "full"):
    """The MoE block of `model` holding its EP=8 local experts, bf16 parameters, deterministic weights.

    `ranks` > 1 builds one rank's block under expert parallel (`benchmarks.moe_ep`): the router and
    the dispatcher see ranks x local experts, the block holds the local ones (the dispatcher
    still needs its EP mesh wired). `flavor` "tiny" gives CPU smoke runs the same structure."""
    local = LOCAL_EXPERTS[model]
    arch = dataclasses.replace(get_arch(model, flavor), num_experts=local * ranks, n_layers=2, n_dense_layers=1)
    cfg = build_model_config(arch)
    configure_moe(cfg, dispatcher=dispatcher)
    moe_cfg = next(layer for layer in cfg.layers if layer.moe is not None).moe
    moe_cfg.routed_experts.inner_experts.num_experts = local
    if dispatcher != "torchtitan":
        moe_cfg.routed_experts.token_dispatcher.pad_multiple = pad_multiple
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


@dataclasses.dataclass(frozen=True)
class Routing:
    """A block's own routing of its tokens, and the replay record the replay cases feed back."""

    scores: torch.Tensor  # [B, S, K]
    ids: torch.Tensor  # [B, S, K]
    counts: torch.Tensor  # routed rows per expert (all experts the router sees)
    replay_ids: torch.Tensor  # [B, S, moe layers = 1, K]: ids with 5% of the tokens routed differently


def routing(moe, x, g: torch.Generator) -> Routing:
    with torch.no_grad():
        scores, ids, _ = moe.router(x, moe.expert_bias_E)
        n = moe.router.num_experts
        counts = torch.bincount(ids.reshape(-1), minlength=n)
        replay_ids = ids.clone()
        flip = torch.rand(x.size(1), device=x.device, generator=g) < 0.05
        replay_ids[0, flip] = (replay_ids[0, flip] + 1) % n
    return Routing(scores, ids, counts, replay_ids.unsqueeze(2))


def block_step(m, x, gy, replay_ids, replay: bool, requantise: bool = False):
    """One forward+backward of block `m` on x, gy; with `replay`, under router replay of `replay_ids`."""
    def step():
        if requantise:  # as after an optimizer step: the fp8 weights are made again
            drop_cached_weights(m)
        zero_grads(m)
        x.grad = None
        with replay_routing(m, replay_ids) if replay else nullcontext():
            m(x).backward(gy)
    return step


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


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """What every case of one run shares: this benchmark's results so far (``res``, its keys of
    the results file), where they are written, the clock, and when to stop starting new cases."""

    res: dict
    results: ResultsFile
    clock: Clock
    deadline: float  # time.time() after which no torchao or compiled case starts
    iters: int

    def save(self) -> None:
        self.results.update(self.res)


def moe_cases(model: str, tokens_list, dev, run: BlockRun, fp8: bool = True):
    log = run.clock.log
    bf16, arch = build_moe(model, dev)
    fp8_model = torchao_model = None
    for tokens in tokens_list:
        fl = block_flops(arch, tokens)
        g = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        gy = torch.randn(1, tokens, arch.dim, device=dev, dtype=torch.bfloat16, generator=g)
        route = routing(bf16, x, g)
        counts = route.counts
        n_iters = run.iters * max(1, 65536 // tokens)  # short steps: more of them, for a stable median
        roof8 = None
        if fp8:
            try:
                roof8_ms = timed(grouped_ffn_roofline(arch, counts, dev, fp8=True), run.iters, 2)
                roof8 = fl["routed"] / roof8_ms / 1e9
                log(f"{model} T={tokens} expert FFN fp8 (titan_ext): {roof8_ms:.2f} ms {roof8:.1f} TFLOP/s")
            except Exception:
                log("fp8 grouped FFN failed:\n" + traceback.format_exc(limit=3))

        def run_block(m, replay, requantise=False):
            return block_step(m, x, gy, route.replay_ids, replay, requantise)

        def add(dtype, replay, ms, variant, **extra):
            tf = fl["total"] / ms / 1e9
            run.res["cases"].append({
                "model": model, "tokens": tokens, "dtype": dtype, "replay": replay, "variant": variant,
                "ms": round(ms, 3), "tflops": round(tf, 1), "roofline_tflops": round(roof, 1),
                "fraction_of_roofline": round(tf / roof, 3),
                "fp8_grouped_ffn_tflops": round(roof8, 1) if roof8 else None,
                "flops": fl, "routed_rows": tokens * arch.top_k, **extra,
            })
            log(f"{model} T={tokens} {dtype} replay={replay} {variant}: {ms:.2f} ms {tf:.1f} TFLOP/s "
                f"({tf / roof:.1%} of roofline)")
            run.save()

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
            stock, _ = build_moe(model, dev, dispatcher="torchtitan")
            add("bf16", False, timed(run_block(stock, False), run.iters, 2), "eager, torchtitan stock dispatcher")
            del stock
        torch.cuda.empty_cache()

        if fp8:
            try:
                if fp8_model is None:
                    fp8_model, _ = build_moe(model, dev)
                    fp8_model.load_state_dict(bf16.state_dict())
                    to_fp8(fp8_model)
                    num = fp8_numerics(bf16, fp8_model, x)
                    run.res["fp8_numerics"][model] = num
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
                run.res["errors"].append(f"{model} T={tokens} fp8: {traceback.format_exc(limit=2)}")
        torch.cuda.empty_cache()
        if fp8 and time.time() < run.deadline:
            try:
                if torchao_model is None:
                    torchao_model, _ = build_moe(model, dev, pad_multiple=16)
                    torchao_model.load_state_dict(bf16.state_dict())
                    to_torchao_fp8(torchao_model)
                    compile_block(torchao_model)
                add("fp8", False, timed(run_block(torchao_model, False), n_iters, 3), "torchao, compiled")
            except Exception:
                log("torchao fp8 block failed:\n" + traceback.format_exc())
                run.res["errors"].append(f"{model} T={tokens} torchao fp8: {traceback.format_exc(limit=2)}")
        torch.cuda.empty_cache()
        if time.time() < run.deadline:
            try:
                cbf = copy.deepcopy(bf16)
                compile_block(cbf)
                for replay, ms in zip((False, True), timed_interleaved(
                        [run_block(cbf, False), run_block(cbf, True)], n_iters, 3)):
                    add("bf16", replay, ms, "compiled")
                del cbf
            except Exception:
                log("bf16 compiled failed:\n" + traceback.format_exc())
                run.res["errors"].append(f"{model} T={tokens} bf16 compiled: {traceback.format_exc(limit=2)}")
        del x, gy
        torch.cuda.empty_cache()
    del bf16, fp8_model, torchao_model
    torch.cuda.empty_cache()

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



# One code object (RoutedExperts.forward) is compiled per model x shape x dtype: 8 here.
@torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512)
def main() -> None:
    ap = moe_arg_parser(__doc__, iters=5)
    ap.add_argument("--budget-s", type=float, default=480, help="no new compiled case after this many seconds")
    ap.add_argument("--skip-fp8", action="store_true", help="bf16 MoE cases only")
    args = ap.parse_args()
    clock = Clock()
    dev = cuda_device()
    res = {
        **run_info(__spec__.name),
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
            "dense_bf16": "8192^3 bf16 torch.matmul, median of 20, measured before and after the cases; "
                          "fraction_of_dense_bf16 = case TFLOP/s / mean of the two",
            "flops": "gate + routed experts + shared expert matmuls, fwd+bwd = 3x fwd",
            "fp8_tolerance": {"loss_rel_diff": 0.01, "grad_rel_l2": 0.1},
            "fp8_grouped_ffn_tflops": "titan_ext's fp8 expert FFN alone (fp8_swiglu, weights quantised every step), "
                                      "fwd+bwd, same routed rows as the roofline",
        },
        "cases": [], "errors": [], "fp8_numerics": {},
    }
    try:
        import torchao

        res["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        res["torchao"] = f"unavailable: {e}"
    res["dense_bf16_tflops"] = {"before": round(dense_bf16_tflops(), 1)}
    run = BlockRun(res, ResultsFile(Path(args.out)), clock, clock.t0 + args.budget_s, args.iters)
    for model in args.models:
        try:
            moe_cases(model, args.tokens, dev, run, fp8=not args.skip_fp8)
        except Exception:
            clock.log("MoE failed:\n" + traceback.format_exc())
            res["errors"].append(f"{model}: {traceback.format_exc(limit=3)}")
            torch.cuda.empty_cache()
    dense = res["dense_bf16_tflops"]
    dense["after"] = round(dense_bf16_tflops(), 1)
    dense["mean"] = round((dense["before"] + dense["after"]) / 2, 1)
    for c in res["cases"]:
        c["fraction_of_dense_bf16"] = round(c["tflops"] / dense["mean"], 3)
    res["wall_s"] = round(time.time() - clock.t0, 1)
    run.save()
    print("\n== summary ==")
    for c in res["cases"]:
        print(f"{c['model']:8s} T={c['tokens']:6d} {c['dtype']:4s} replay={int(c['replay'])} {c['variant']:38s} "
              f"{c['ms']:9.2f} ms {c['tflops']:7.1f} TF/s  roof {c['roofline_tflops']:6.1f} ({c['fraction_of_roofline']:.1%})")
    print(f"dense bf16 matmul {dense}")
    for k, v in res["fp8_numerics"].items():
        print("fp8 numerics", k, v["loss_rel_diff"], max(v["grad_rel_l2"].values()))
    for e in res["errors"]:
        print("ERROR", e[:400])


if __name__ == "__main__":
    main()
