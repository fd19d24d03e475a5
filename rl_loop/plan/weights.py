"""`moerl plan weights`: bytes per link and predicted time of one weight update to inference.

The update #18 builds: every trainer rank sends only the slices it owns (its FSDP shard, its
EP experts; `vllm_ext.transport.plan.reshard` decides which), in parallel, and every inference
GPU receives only the slice its replica's TP/EP rank loads. Two ways to reach R replicas:

* direct: each replica pulls its copy from the trainer ranks, so every trainer GPU sends R
  copies of its shard;
* relay: the trainer sends one copy, into the first replica, and the replicas forward it
  along a chain slice by slice (each inference GPU receives its slice once and sends it once),
  as checkpoint-engine's broadcast does; pipelined, the chain costs one slice per hop only
  for the first bucket.

The time of a way is its busiest link's bytes over that link's speed, plus the replica's
pause-to-resume (measured, weight_sync.json), plus applying the update: past the copy
itself, vLLM's weight loaders cost a fixed time per tensor (weight_reload.json), and an
inference GPU loads its slice of every checkpoint tensor, bf16 routed experts stacked per
layer and projection (vllm_ext/weights/reload.py), block-fp8 ones one tensor and one scale
per expert.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .rates import WEIGHT_RELOAD, WEIGHT_SYNC, Rate, Rates

BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128)}  # block fp8: one fp32 scale per 128x128 block
# HF tensors per layer besides the routed experts (DeepSeek-V3 layout: MLA's 5 projections and 2 norms,
# the layer's 2 norms, then a dense FFN's 3 or a MoE layer's router weight, bias and shared expert's 3),
# and outside the layers (embedding, final norm, LM head); GLM-5's DSA indexer adds a few per layer, not counted
DENSE_LAYER_TENSORS, MOE_LAYER_TENSORS, OUTER_TENSORS = 12, 14, 3


@dataclass(frozen=True)
class WeightSyncSetup:
    params: int
    trainer_gpus: int
    replicas: int
    gpus_per_replica: int
    trainer_link_gbps: float  # per trainer GPU, out of its node
    inference_link_gbps: float  # per inference GPU, into (and out of) its node
    dtype: str = "bf16"
    loader_tensors: int = 0  # tensors an inference GPU's weight loaders take per update (loader_tensors())


@dataclass(frozen=True)
class WeightSyncPlan:
    bytes_per_version: float
    way: str
    trainer_gpu_sends: float
    inference_gpu_receives: float
    inference_gpu_sends: float
    transfer_s: float
    pause_s: Rate
    other_way_s: float
    apply_s: float
    per_tensor_s: Rate

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.pause_s.value + self.apply_s

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("pause_s", "per_tensor_s"):
            d[k] = {"value": getattr(self, k).value, "source": getattr(self, k).source}
        d["total_s"] = self.total_s
        return d


def pause_to_resume(rates: Rates) -> Rate:
    return Rate(rates.file(WEIGHT_SYNC)["pause_to_resume_s"], "s", f"{WEIGHT_SYNC}: pause_to_resume_s")


def per_tensor_reload(rates: Rates) -> Rate:
    return Rate(rates.file(WEIGHT_RELOAD)["per_tensor_s"], "s", f"{WEIGHT_RELOAD}: per_tensor_s")


def loader_tensors(arch, *, stacked: bool = True, scales: bool = False) -> int:
    """Tensors one inference GPU's weight loaders take per update (its TP slice of each): every
    checkpoint tensor, the routed experts one per layer and projection when ``stacked``
    (moerl's reload of unquantized experts), else one per expert and projection, each with its
    block-fp8 scale when ``scales``."""
    moe = arch.n_layers - arch.n_dense_layers
    experts = 3 * moe * (1 if stacked else arch.num_experts) * (2 if scales else 1)
    return OUTER_TENSORS + DENSE_LAYER_TENSORS * arch.n_dense_layers + MOE_LAYER_TENSORS * moe + experts


def transfer_seconds(setup: WeightSyncSetup, way: str) -> tuple[float, float, float, float]:
    """(seconds, bytes each trainer GPU sends, bytes each inference GPU receives, and sends) of `way`."""
    b = setup.params * BYTES_PER_PARAM[setup.dtype]
    slice_bytes = b / setup.gpus_per_replica
    if way == "direct":
        sends, recv, fwd = setup.replicas * b / setup.trainer_gpus, slice_bytes, 0.0
    else:
        sends, recv, fwd = b / setup.trainer_gpus, slice_bytes, slice_bytes * (setup.replicas > 1)
    seconds = max(sends / (setup.trainer_link_gbps * 1e9), max(recv, fwd) / (setup.inference_link_gbps * 1e9))
    return seconds, sends, recv, fwd


def plan_weight_sync(setup: WeightSyncSetup, rates: Rates) -> WeightSyncPlan:
    ways = {w: transfer_seconds(setup, w) for w in ("direct", "relay")}
    best = min(ways, key=lambda w: ways[w][0])
    seconds, sends, recv, fwd = ways[best]
    per_tensor = per_tensor_reload(rates)
    return WeightSyncPlan(
        bytes_per_version=setup.params * BYTES_PER_PARAM[setup.dtype], way=best, trainer_gpu_sends=sends,
        inference_gpu_receives=recv, inference_gpu_sends=fwd, transfer_s=seconds, pause_s=pause_to_resume(rates),
        other_way_s=ways["relay" if best == "direct" else "direct"][0],
        apply_s=setup.loader_tensors * per_tensor.value, per_tensor_s=per_tensor)


def lane_rates(rates: Rates) -> dict[str, Rate]:
    """Each lane's rate at its largest measured run of weight_sync.json (one sender, one receiver)."""
    out: dict[str, tuple[int, Rate]] = {}
    for r in rates.weight_sync_runs():
        if r["transport"] not in out or r["bytes"] > out[r["transport"]][0]:
            out[r["transport"]] = (r["bytes"], Rate(r["gbps"], "GB/s", f"{r['key']}.gbps ({r['bytes']} bytes)"))
    return {lane: rate for lane, (_, rate) in out.items()}
