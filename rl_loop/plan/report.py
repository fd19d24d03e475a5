"""A plan as text (what `moerl plan` prints) and as a JSON-ready dict (`--json`)."""

from __future__ import annotations

from dataclasses import asdict

from .layout import Workload
from .memory import LayerMemory
from .rates import Rate
from .search import Plan
from .weights import WeightSyncPlan, WeightSyncSetup

GB = 1e9


def inference_need(plan: Plan, work: Workload, replica_tokens_per_s: float | None) -> dict:
    """Tokens/s the inference side must generate so the next step's rollouts are ready when the
    trainer finishes this one (async, one step of lag): a step's tokens per predicted step time."""
    need = work.tokens_per_step / plan.time.total
    out = {"tokens_per_step": work.tokens_per_step, "tokens_per_s_needed": need,
           "tokens_per_s_per_inference_gpu": need / work.inference_gpus if work.inference_gpus else None,
           "replica_tokens_per_s": replica_tokens_per_s, "replicas_needed": None}
    if replica_tokens_per_s:
        out["replicas_needed"] = -(-need // replica_tokens_per_s)
    return out


def plan_dict(plan: Plan, work: Workload, replica_tokens_per_s: float | None = None) -> dict:
    return {
        "layout": {**asdict(plan.layout), "dp_replicate": plan.layout.replicas(work.trainer_gpus)},
        "fits": plan.fits(work),
        "memory_bytes": plan.memory.to_dict(),
        "comm_bytes_per_step": plan.comm.to_dict(),
        "step_time_s": plan.time.to_dict(),
        "inference": inference_need(plan, work, replica_tokens_per_s),
    }


def _layer(name: str, m: LayerMemory) -> str:
    return (f"    {name:<26} saved {m.saved / GB:7.2f} GB, peak {m.peak / GB:7.2f} GB "
            f"(+ {m.grad_bytes / GB:.2f} GB weight grads at that stage)")


def plan_text(plan: Plan, work: Workload, replica_tokens_per_s: float | None = None) -> str:
    m, c, t = plan.memory, plan.comm, plan.time
    tokens = work.seq_len // plan.layout.cp
    inf = inference_need(plan, work, replica_tokens_per_s)
    optimizer = f"optimizer {m.optimizer / GB:.1f}"
    if m.optimizer_on_host:
        optimizer += (f" (on the GPU for the step only: the peak holds the larger of it and the "
                      f"{m.working / GB:.1f} GB working set)")
    lines = [
        f"{plan.layout.label()}  (dp_replicate {plan.layout.replicas(work.trainer_gpus)}): "
        f"{m.total / GB:.1f} GB per GPU of {work.gpu_bytes / GB:.0f} ({'fits' if plan.fits(work) else 'DOES NOT FIT'}), "
        f"predicted step {t.total:.1f} s",
        f"  memory per GPU (GB): params {m.params / GB:.1f}, grads {m.grads / GB:.1f}, {optimizer}, "
        f"unsharded in flight {m.unsharded / GB:.1f}, activations {m.activations / GB:.1f}, "
        f"logits {m.logits / GB:.1f}, reserved {m.reserved / GB:.1f}; host (offload) {m.host / GB:.1f}",
        f"  one layer at {tokens} local tokens (no checkpointing):",
        _layer("attention (DSA/MLA)", m.attention_layer),
        _layer("MoE block", m.ffn_layer),
        f"  comm per GPU per step (GB): FSDP all-gather {c.fsdp_all_gather / GB:.1f}, reduce-scatter "
        f"{c.fsdp_reduce_scatter / GB:.1f}, replica all-reduce {c.replica_all_reduce / GB:.1f}, EP all-to-all "
        f"{c.ep_all_to_all / GB:.1f}, CP latent gathers {c.cp_gather / GB:.2f}; weight sync sends {c.weight_sync / GB:.1f}",
        f"  step time (s), {t.sequences_per_rank} sequences per rank: attention {t.attention:.1f}, MoE {t.moe:.1f}, "
        f"dense+LM head {t.dense:.1f}, AC recompute {t.recompute:.1f}, optimizer step + FSDP casts "
        f"{t.per_parameter:.2f}, unmodelled (calibrated) {t.unmodelled:.1f}, "
        f"EP all-to-all {t.ep_all_to_all:.1f}, "
        f"CP gathers {t.cp_gather:.2f}, FSDP not hidden {t.fsdp_exposed:.1f}, optimizer offload copies "
        f"{t.optimizer_offload:.1f}",
        f"  inference: {inf['tokens_per_s_needed']:.0f} tokens/s to keep the trainer busy"
        + (f" ({inf['tokens_per_s_per_inference_gpu']:.0f} per inference GPU)" if work.inference_gpus else "")
        + (f", {inf['replicas_needed']} replicas at {replica_tokens_per_s:g} tokens/s" if replica_tokens_per_s else ""),
    ]
    return "\n".join(lines)


def rates_text(plan: Plan) -> str:
    return "rates of plan 1 (each with its file and key):\n" + "\n".join(f"  {k}: {v}" for k, v in plan.time.rates.items())


def weights_text(setup: WeightSyncSetup, p: WeightSyncPlan, lanes: dict[str, Rate]) -> str:
    return "\n".join([
        f"{setup.params / 1e9:.0f}B parameters in {setup.dtype}: {p.bytes_per_version / GB:.0f} GB per version, "
        f"{setup.trainer_gpus} trainer GPUs -> {setup.replicas} replicas x {setup.gpus_per_replica} GPUs",
        f"  way: {p.way} (the other way: {p.other_way_s:.2f} s)",
        f"  each trainer GPU sends {p.trainer_gpu_sends / GB:.2f} GB at {setup.trainer_link_gbps:g} GB/s; "
        f"each inference GPU receives {p.inference_gpu_receives / GB:.2f} GB and forwards "
        f"{p.inference_gpu_sends / GB:.2f} GB at {setup.inference_link_gbps:g} GB/s",
        f"  apply: {setup.loader_tensors} tensors per inference GPU through vLLM's weight loaders "
        f"x {p.per_tensor_s.value * 1e3:.3f} ms [{p.per_tensor_s.source}] = {p.apply_s:.2f} s",
        f"  predicted update: transfer {p.transfer_s:.2f} s + pause-to-resume {p.pause_s.value:.2f} s "
        f"[{p.pause_s.source}] + apply {p.apply_s:.2f} s = {p.total_s:.2f} s",
        "  moerl's lanes as measured on one host, one sender and one receiver (for links of that kind):",
        *(f"    {lane}: {rate}" for lane, rate in lanes.items()),
    ])
