"""`moerl plan` and `moerl plan weights`: flags in, one plan (or the fastest few) out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import positive_int
from .layout import AC_MODES, H200_BYTES, RECIPES, Layout, PlanError, Workload, check_layout
from .model import MODELS, load_arch, param_counts
from .rates import SHIPPED, Rates
from .report import plan_dict, plan_text, rates_text, weights_text
from .search import make_plan, search
from .weights import BYTES_PER_PARAM, WeightSyncSetup, lane_rates, loader_tensors, plan_weight_sync


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, required=True, help="titan_ext model (full size)")
    p.add_argument("--trainer-gpus", type=positive_int, required=True, metavar="G", help="trainer H200s")
    p.add_argument("--results", type=Path, default=SHIPPED, metavar="DIR",
                   help="read the measured rates from the benchmarks' JSON files in DIR (e.g. benchmarks/results) "
                        "instead of the copies shipped with moerl")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl plan", description="Memory per GPU, communication and predicted step time of an RL run's "
        "trainer, from rates measured in benchmarks/results. Give a layout (--cp --ep --fp8/--no-fp8 --ac) to plan "
        "it; leave any of it out to search and print the fastest layouts that fit. `moerl plan weights --help`: the "
        "weight update to inference.")
    _common(p)
    p.add_argument("--seq-len", type=positive_int, required=True, metavar="N", help="tokens per packed training sequence")
    p.add_argument("--inference-gpus", type=positive_int, metavar="I",
                   help="inference H200s, for the tokens/s each must generate (default: not given)")
    p.add_argument("--batch", type=positive_int, default=256, help="samples per step (default %(default)s)")
    p.add_argument("--sample-tokens", type=int, default=0, metavar="N",
                   help="mean tokens per sample (default: --seq-len, every sample fills a sequence)")
    p.add_argument("--cp", type=positive_int, help="context-parallel degree (default: searched)")
    p.add_argument("--ep", type=positive_int, help="expert-parallel degree (default: searched)")
    p.add_argument("--fsdp", type=positive_int, help="FSDP shard degree (default: trainer GPUs / cp)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="fp8 MoE experts, or bf16 with --no-fp8 (default: searched)")
    p.add_argument("--recipe", choices=tuple(RECIPES), default="titan_ext",
                   help="memory techniques: titan_ext (what titan_ext and moerl's trainer run: optimizer-state "
                        "offload, 1024-token LM-head + loss chunks, AC none|full|offload searched) or prime_rl (its "
                        "GLM-5 131k config: the same with AC offload only); the three flags below override it "
                        "(default %(default)s)")
    p.add_argument("--ac", choices=AC_MODES,
                   help="activation checkpointing per layer; offload: full, with each layer's input in host memory "
                        "(--titan_ext.activation_offload) (default: searched over the recipe's)")
    p.add_argument("--loss-chunk", type=int, metavar="N",
                   help="tokens per LM-head + loss chunk (train.loss_chunk_tokens); 0: the whole local sequence "
                        "(default: the recipe's)")
    p.add_argument("--optim-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="AdamW moments in host memory between steps (train.optimizer_offload) (default: the recipe's)")
    p.add_argument("--host-gbps", type=float,
                   help="GB/s per GPU at which --optim-offload moves the moments out and back (default: the rate "
                        "titan_ext's offload reached on one H200, long_context_h200.json)")
    p.add_argument("--internode-gbps", type=float, default=50.0,
                   help="GB/s per GPU between nodes (assumed: one 400 Gb/s NIC per GPU) (default %(default)s)")
    p.add_argument("--gpu-gb", type=float, default=H200_BYTES / 1e9, help="GB per GPU (default %(default)s)")
    p.add_argument("--replica-tokens-per-s", type=float, metavar="R",
                   help="generation tokens/s of one inference replica, for the replica count (default: not given)")
    p.add_argument("--top", type=positive_int, default=5, help="layouts printed by a search (default %(default)s)")
    return p


def weights_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl plan weights", description="Bytes per link and predicted time of one weight update from the "
        "trainer's shards to every inference replica (sharded send, no gather).")
    _common(p)
    p.add_argument("--inference-gpus", type=positive_int, required=True, metavar="I", help="inference H200s")
    p.add_argument("--ep", type=positive_int, default=1, help="trainer expert-parallel degree (default %(default)s)")
    p.add_argument("--gpus-per-replica", type=positive_int, default=8, help="GPUs of one vLLM replica (default %(default)s)")
    p.add_argument("--trainer-link-gbps", type=float, default=50.0,
                   help="GB/s out of each trainer GPU's node share (default %(default)s)")
    p.add_argument("--inference-link-gbps", type=float, default=50.0,
                   help="GB/s into each inference GPU's node share (default %(default)s)")
    p.add_argument("--dtype", choices=tuple(BYTES_PER_PARAM), default="bf16",
                   help="weights on the wire: bf16, or block fp8 as Kimi-K2 / GLM-5 are served (default %(default)s)")
    return p


def run_train(argv: list[str]) -> int:
    a = train_parser().parse_args(argv)
    rates = Rates(a.results)
    recipe = RECIPES[a.recipe]
    work = Workload(model=a.model, seq_len=a.seq_len, trainer_gpus=a.trainer_gpus, inference_gpus=a.inference_gpus or 0,
                    batch=a.batch, sample_tokens=a.sample_tokens,
                    loss_chunk=recipe.loss_chunk if a.loss_chunk is None else a.loss_chunk,
                    optim_offload=recipe.optim_offload if a.optim_offload is None else a.optim_offload,
                    gpu_bytes=a.gpu_gb * 1e9, internode_gbps=a.internode_gbps, host_gbps=a.host_gbps)
    num_experts = load_arch(a.model).num_experts
    cp = a.cp or 1
    check_layout(Layout(cp=cp, ep=a.ep or 1, fsdp=a.fsdp or a.trainer_gpus // cp, fp8=bool(a.fp8), ac=a.ac or "none"),
                 work, num_experts)
    if a.cp and a.ep and a.fp8 is not None and a.ac:
        layout = Layout(cp=a.cp, ep=a.ep, fsdp=a.fsdp or a.trainer_gpus // a.cp, fp8=a.fp8, ac=a.ac)
        plan = make_plan(layout, work, rates)
        if not plan.fits(work):
            raise PlanError(f"{plan.layout.label()} needs {plan.memory.total / 1e9:.1f} GB per GPU, over the "
                            f"{work.gpu_bytes / 1e9:.0f} GB of one GPU: raise --cp or --ep, use --ac offload, "
                            f"--loss-chunk or --optim-offload, or leave the layout out to search")
        plans, tried = [plan], 1
    else:
        plans, tried = search(work, rates, top=a.top, cp=a.cp, ep=a.ep, fsdp=a.fsdp, fp8=a.fp8, ac=a.ac,
                              ac_modes=recipe.ac_modes)
        if not plans:
            raise PlanError(f"none of the {tried} layouts tried fits {work.model} at --seq-len {work.seq_len} in "
                            f"{work.gpu_bytes / 1e9:.0f} GB per GPU: add trainer GPUs or shorten --seq-len")
    if a.json:
        print(json.dumps({"model": a.model, "recipe": a.recipe,
                          "workload": vars(work) | {"tokens_per_step": work.tokens_per_step},
                          "layouts_tried": tried, "plans": [plan_dict(p, work, a.replica_tokens_per_s) for p in plans],
                          "rates": plans[0].time.rates}, indent=2))
        return 0
    print(f"{a.model}, {work.seq_len} tokens per sequence, {work.batch} samples x {work.tokens_per_sample} tokens "
          f"per step, {work.trainer_gpus} trainer GPUs, recipe {a.recipe}: "
          + (f"the fastest {len(plans)} of {tried} layouts that fit" if tried > 1 else "the layout given"))
    for i, p in enumerate(plans, 1):
        print(f"\n{i}. " + plan_text(p, work, a.replica_tokens_per_s))
    print("\n" + rates_text(plans[0]))
    return 0


def run_weights(argv: list[str]) -> int:
    a = weights_parser().parse_args(argv)
    arch = load_arch(a.model)
    if arch.num_experts % a.ep or a.trainer_gpus % a.ep:
        raise PlanError(f"--ep {a.ep} must divide {a.model}'s {arch.num_experts} experts and --trainer-gpus "
                        f"{a.trainer_gpus}")
    if a.inference_gpus < a.gpus_per_replica or a.inference_gpus % a.gpus_per_replica:
        raise PlanError(f"--inference-gpus {a.inference_gpus} must be a positive multiple of --gpus-per-replica "
                        f"{a.gpus_per_replica}")
    setup = WeightSyncSetup(params=param_counts(arch).total, trainer_gpus=a.trainer_gpus,
                            replicas=a.inference_gpus // a.gpus_per_replica, gpus_per_replica=a.gpus_per_replica,
                            trainer_link_gbps=a.trainer_link_gbps, inference_link_gbps=a.inference_link_gbps,
                            dtype=a.dtype,
                            # reload.py stacks unquantized experts only; block-fp8 ones load one by one, with scales
                            loader_tensors=loader_tensors(arch, stacked=a.dtype == "bf16", scales=a.dtype == "fp8"))
    rates = Rates(a.results)
    plan, lanes = plan_weight_sync(setup, rates), lane_rates(rates)
    if a.json:
        print(json.dumps({"setup": vars(setup) | {"ep": a.ep}, "plan": plan.to_dict(),
                          "measured_lanes": {k: {"gbps": v.value, "source": v.source} for k, v in lanes.items()}},
                         indent=2))
    else:
        print(weights_text(setup, plan, lanes))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    weights = bool(argv) and argv[0] == "weights"
    try:
        return run_weights(argv[1:]) if weights else run_train(argv)
    except (ValueError, FileNotFoundError) as e:  # PlanError is a ValueError
        print(f"moerl plan{' weights' if weights else ''}: error: {e}", file=sys.stderr)
        return 2
