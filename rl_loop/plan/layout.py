"""The trainer layout a plan is made for, the workload, and the checks that reject bad combinations."""

from __future__ import annotations

from dataclasses import dataclass

AC_MODES = ("none", "full", "offload")
H200_BYTES = 141e9
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Recipe:
    """The memory techniques a run uses beyond the mesh: the defaults of `--optim-offload`,
    `--loss-chunk` and the AC modes a search tries when `--ac` is not given."""

    optim_offload: bool
    loss_chunk: int
    ac_modes: tuple[str, ...]


# titan_ext: what `torchtitan train --extension titan_ext` and moerl's trainer run: optimizer-state
# offload (--titan_ext.optimizer_offload, train.optimizer_offload), 1024-token LM-head + loss
# chunks (--titan_ext.loss_chunks, train.loss_chunk_tokens), AC none|full|offload (offload: full AC
# with --titan_ext.activation_offload, train.activation_offload); every AC mode is searched.
# prime_rl: PrimeIntellect-ai/prime-rl examples/advanced/glm-5.2/swe-llmd.toml on top of its trainer
# defaults (configs/trainer.py ModelConfig: optim_cpu_offload = True, fp32 optimization and reduce
# dtypes): fused_lm_head_token_chunk_size = 1024, [trainer.model.ac] freq = 1 with
# [trainer.model.ac_offloading] max_inflight_activations = 1, so AC offload only.
RECIPES = {
    "titan_ext": Recipe(optim_offload=True, loss_chunk=1024, ac_modes=AC_MODES),
    "prime_rl": Recipe(optim_offload=True, loss_chunk=1024, ac_modes=("offload",)),
}


class PlanError(ValueError):
    """A combination that cannot run; the message is one line saying what to change."""


@dataclass(frozen=True)
class Workload:
    """What one RL step trains on and where: `batch` samples of `sample_tokens` each, packed
    into sequences of `seq_len` tokens, on `trainer_gpus` (+ `inference_gpus` generating)."""

    model: str
    seq_len: int
    trainer_gpus: int
    inference_gpus: int = 0
    batch: int = 256
    sample_tokens: int = 0  # 0: every sample fills a whole sequence
    loss_chunk: int = 0  # tokens per LM-head + loss chunk; 0: the whole local sequence at once
    optim_offload: bool = False  # AdamW moments in host memory between steps, on the GPU only for step()
    gpu_bytes: float = H200_BYTES
    internode_gbps: float = 50.0  # per GPU, one 400 Gb/s NIC each: not measurable here, a flag
    host_gbps: float | None = None  # the moments' host <-> GPU rate per GPU; None: titan_ext's, measured

    @property
    def tokens_per_sample(self) -> int:
        return self.sample_tokens or self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.tokens_per_sample

    @property
    def sequences_per_step(self) -> int:
        return -(-self.tokens_per_step // self.seq_len)


@dataclass(frozen=True)
class Layout:
    """FSDP2 x CP x EP on the trainer (no TP/PP): `fsdp` x `cp` ranks shard every parameter
    (dp_replicate = trainer_gpus / (fsdp x cp) replicas of that), EP takes `ep` of those ranks
    for the routed experts. `ac`: activation checkpointing per layer, "offload" also moves
    the saved layer inputs to host memory."""

    cp: int
    ep: int
    fsdp: int
    fp8: bool
    ac: str

    def label(self) -> str:
        return f"cp {self.cp}, ep {self.ep}, fsdp {self.fsdp}, {'fp8' if self.fp8 else 'bf16'}, ac {self.ac}"

    def replicas(self, trainer_gpus: int) -> int:
        return trainer_gpus // (self.fsdp * self.cp)


def check_layout(layout: Layout, work: Workload, num_experts: int) -> None:
    """Raise PlanError (one line) for a layout that cannot run this workload; memory is checked apart."""
    g = work.trainer_gpus
    if layout.ac not in AC_MODES:
        raise PlanError(f"--ac {layout.ac} is not a mode: use one of {', '.join(AC_MODES)}")
    if work.seq_len % layout.cp:
        raise PlanError(f"--cp {layout.cp} does not divide --seq-len {work.seq_len}: context parallel splits each "
                        f"sequence evenly, pick a CP degree that divides it")
    if g % layout.cp:
        raise PlanError(f"--cp {layout.cp} does not divide --trainer-gpus {g}")
    if (g // layout.cp) % layout.fsdp:
        raise PlanError(f"--fsdp {layout.fsdp} does not divide --trainer-gpus / --cp = {g // layout.cp}")
    if num_experts % layout.ep:
        raise PlanError(f"--ep {layout.ep} does not divide {work.model}'s {num_experts} experts: pick an EP degree "
                        f"that divides {num_experts}")
    if (layout.fsdp * layout.cp) % layout.ep:
        raise PlanError(f"--ep {layout.ep} does not divide --fsdp x --cp = {layout.fsdp * layout.cp}: EP takes its "
                        f"ranks from the FSDP x CP group")
    if work.loss_chunk < 0 or work.seq_len < 1 or work.batch < 1:
        raise PlanError("--seq-len, --batch must be >= 1 and --loss-chunk >= 0")
    if work.sample_tokens > work.seq_len:
        raise PlanError(f"--sample-tokens {work.sample_tokens} is over --seq-len {work.seq_len}: a sample is packed "
                        f"into one sequence, raise --seq-len or shorten the samples")
