"""The RL trainer: TorchTitan (with titan_ext) under torchrun, fed batches by the orchestrator.

TorchTitan builds everything a trainer needs (model with FSDP2/EP, optimizer,
LR schedule, distributed checkpointing, HF loading through titan_ext's adapter);
this module only replaces the data and the loss: each step reads one packed
batch (`rl_loop.batch.Batch`) from the run directory, runs forward with router
replay, applies `rl_loop.loss.policy_loss`, steps the optimizer, saves a
TorchTitan checkpoint every `checkpoint_interval` steps (for `moerl rl --resume`)
and publishes the new weights as an HF checkpoint for the inference replicas.

The run directory is the whole protocol between the orchestrator and the trainer
(`rl_loop.run_dir`), so either can be restarted independently.

usage: torchrun --nproc_per_node N -m rl_loop.trainer RUN_DIR
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .batch import Batch
from .loss import LossConfig, policy_loss, token_logprobs_and_entropy
from .run_dir import batch_path, metrics_path, weights_dir, write_atomic
from .weight_lane import sync_dir, written_off

if TYPE_CHECKING:
    from .config import RLConfig


@dataclass
class TrainerSpec:
    """What the orchestrator tells the trainer (written as RUN_DIR/trainer/spec.json)."""

    model: str
    flavor: str
    init_checkpoint: str
    steps: int
    lr: float
    replay: bool
    max_ratio: float
    checkpoint_interval: int
    wire_dtype: str = "bfloat16"
    weight_lane: str = "fs"  # rl_loop.weight_lane: fs, shm or net
    replica_tp: list[int] | None = None  # sharded lanes: TP size of each replica, in order
    dispatcher: str = "lean"
    fp8: bool = False
    max_grad_norm: float = 1.0
    lr_warmup_steps: int = 0
    context_parallel: int = 1  # TorchTitan's --parallelism.context_parallel_degree
    loss_chunk_tokens: int = 0  # rl_loop.chunked_loss; 0: whole sequences
    indexer_fp8: bool = True  # titan_ext.models.glm5.dsa: rank keys as vLLM's indexer
    optimizer_offload: bool = False  # titan_ext.offload
    activation_offload: bool = False  # titan_ext.offload
    poll_s: float = 0.05

    @classmethod
    def from_config(cls, cfg: "RLConfig", init_checkpoint: Path, weight_lane: str = "fs",
                    replica_tp: list[int] | None = None) -> "TrainerSpec":
        """The trainer's part of a `moerl rl` config, starting from `init_checkpoint`."""
        t = cfg.train
        return cls(model=cfg.model.arch, flavor=cfg.model.flavor, init_checkpoint=str(init_checkpoint),
                   steps=t.steps, lr=t.lr, lr_warmup_steps=t.lr_warmup_steps, replay=t.replay, max_ratio=t.max_ratio,
                   checkpoint_interval=t.checkpoint_interval, dispatcher=t.dispatcher, fp8=t.fp8,
                   context_parallel=t.context_parallel, loss_chunk_tokens=t.loss_chunk_tokens,
                   indexer_fp8=t.indexer_fp8, optimizer_offload=t.optimizer_offload,
                   activation_offload=t.activation_offload,
                   wire_dtype=cfg.model.inference_dtype,
                   weight_lane=weight_lane, replica_tp=replica_tp)

    def save(self, run_dir: Path) -> None:
        path = run_dir / "trainer" / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> "TrainerSpec":
        return cls(**json.loads((run_dir / "trainer" / "spec.json").read_text()))


def rl_step(model: torch.nn.Module, batch: Batch, loss_config: LossConfig, *, replay: bool,
            total_tokens: int | None = None, loss_chunk_tokens: int = 0) -> dict:
    """Forward (replaying `batch.replay_ids` when `replay`), loss, backward. Returns metrics.

    Under context parallel the model trains on this rank's positions of every sequence
    (TorchTitan's layout, `sequence_shards`), padded first to 2 * cp equal chunks.
    `total_tokens` is the completion-token count of the whole batch (every data- and
    context-parallel rank's part), so the gradients FSDP sums across ranks equal the
    single-process ones; "loss" is this rank's share of the batch loss. With
    `loss_chunk_tokens`, the LM head and the loss run on chunks of about that many of this
    rank's positions (`rl_loop.chunked_loss`; the sequence is padded to equal chunks).
    """
    from titan_ext.models.context_parallel import sequence_shards
    from titan_ext.replay import disagreement_by_layer, replay_index_keys, replay_routing, shard_replay_ids

    from .chunked_loss import chunk_count, chunked_policy_loss

    shards = sequence_shards(model)
    seq = batch.mask.size(1)
    world = 1 if shards is None else shards.world
    multiple = 1 if shards is None else 2 * world
    chunks = 1
    if loss_chunk_tokens:
        chunks = chunk_count(math.ceil(seq / multiple) * multiple // world, loss_chunk_tokens)
        multiple *= chunks
    batch = batch.padded(multiple)
    padding = (torch.arange(batch.mask.size(1)) >= seq).expand_as(batch.mask)
    part = (batch.tokens[:, :-1], batch.tokens[:, 1:], batch.mask, batch.logp_infer, padding)
    inputs, targets, mask, logp_infer, padding = part if shards is None else shards.shard(*part)
    replay_ids = shard_replay_ids(model, batch.replay_ids) if replay else None
    replay_keys = shard_replay_ids(model, batch.replay_keys) if replay and batch.replay_keys is not None else None
    with replay_routing(model, replay_ids, padding) as routers, \
            replay_index_keys(model, replay_keys, batch.mask.size(1)) as indexers:
        if loss_chunk_tokens:
            model._skip_lm_head = True  # TorchTitan's Decoder then returns the normed hidden states
            try:
                hidden = model(inputs)
            finally:
                model._skip_lm_head = False
            out = chunked_policy_loss(hidden, model.lm_head, targets, logp_infer, batch.advantages, mask, loss_config,
                                      total_tokens, chunks)
        else:
            logp, entropy = token_logprobs_and_entropy(model(inputs), targets)
            out = policy_loss(logp, logp_infer, batch.advantages, mask, loss_config, total_tokens)
            out.entropy_mean = (entropy * mask).sum().item() / max(out.num_tokens, 1)
        out.loss.backward()
    disagreement = [d for d in disagreement_by_layer(routers) if d is not None]
    index_disagreement = [m.disagreement for m in indexers if m.disagreement is not None]
    return {
        "loss": out.loss.item(),
        "tokens": out.num_tokens,
        "mismatch_k3_mean": out.k3_mean,
        "mismatch_k3_max": out.k3_max,
        "extreme_frac": out.extreme_frac,
        "masked_frac": out.masked_frac,
        "entropy_mean": out.entropy_mean,
        "router_disagreement": sum(disagreement) / len(disagreement) if disagreement else None,
        # replaying indexer keys: how often the trainer's own indexer would have chosen other keys
        "indexer_disagreement": sum(index_disagreement) / len(index_disagreement) if index_disagreement else None,
    }


def reduce_metrics(local: dict, total_tokens: int) -> dict:
    """The batch loss (the sum of the ranks' shares), token-weighted means and the max of the
    per-rank mismatch metrics, over all ranks."""
    n = local["tokens"]
    keys = ("mismatch_k3_mean", "extreme_frac", "masked_frac", "entropy_mean")
    sums = torch.tensor([local["loss"], *(local[k] * n for k in keys)], dtype=torch.float64)
    peak = torch.tensor([local["mismatch_k3_max"]])
    dist.all_reduce(sums)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    loss, *weighted = sums.tolist()
    return {"loss": loss, **{k: v / total_tokens for k, v in zip(keys, weighted)},
            "mismatch_k3_max": peak.item(), "tokens": total_tokens}


def publish_weights(model: torch.nn.Module, out: Path, version: int, wire_dtype: torch.dtype, quant=None) -> None:
    """Write policy `version` for the replicas (vllm_ext's filesystem transport), one layer at a time.

    `quant`: the block-fp8 format of the checkpoint the replicas serve (None: plain `wire_dtype`).

    Every rank takes part in the per-layer gathers; rank 0 writes the shards and,
    last, the commit marker, so a replica never loads a half-written version.
    """
    from titan_ext.weights import drain, iter_hf_weights
    from vllm_ext.transport.wire import write_fs

    if dist.get_rank() == 0:
        write_fs(out, iter_hf_weights(model, dtype=wire_dtype, quant=quant), version)
    else:
        drain(model, dtype=wire_dtype, quant=quant)


class ShardedPublisher:
    """This rank's end of the sharded lanes (``vllm_ext.transport.sharded``): its pieces of
    every replica worker's weights, planned once from every rank's owned boxes (metadata
    only is exchanged), sent straight from its own shards each step: nothing is gathered."""

    def __init__(self, model: torch.nn.Module, replica_tp: list[int], lane: str, wire_dtype: torch.dtype,
                 timeout_s: float = 600.0):
        from titan_ext.weights import hf_metadata, owned_hf_slices, wire_slices
        from vllm_ext.transport.format import dtype_name, dtype_of
        from vllm_ext.transport.plan import expert_groups, replica_needs, reshard, wire_shapes
        from vllm_ext.transport.shm import RingShape
        from vllm_ext.transport.sharded import ShardedSender

        self.model, self.wire_dtype, self.rank = model, wire_dtype, dist.get_rank()
        meta = hf_metadata(model, dtype=wire_dtype)
        hf_shapes = {n: tuple(shape) for n, _, shape in meta}
        groups = expert_groups(hf_shapes)  # the wire layout: experts stacked
        self.shapes = wire_shapes(hf_shapes, groups)
        hf_dtypes = {n: dtype_name(d) for n, d, _ in meta}
        self.dtypes = {g: hf_dtypes[ms[0]] for g, ms in groups.items()}
        mine = wire_slices(owned_hf_slices(model), groups)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(s.name, s.box) for s in mine])
        owned: dict[str, list] = {}
        for r, slices in enumerate(everyone):
            for name, box in slices:
                owned.setdefault(name, []).append((r, box))
        needs = [n for tp in replica_tp for n in replica_needs(self.shapes, tp)]
        itemsize = {g: dtype_of(d).itemsize for g, d in self.dtypes.items()}
        self.pieces = [p for p in reshard(list(self.shapes), owned, needs, itemsize) if p.sender == self.rank]
        self.slices = {s.name: s for s in mine}
        self.reader = None  # the last update's OwnedReader (it keeps the boxes)
        self.replica_tp = replica_tp
        self.replica_of = [i for i, tp in enumerate(replica_tp) for _ in range(tp)]  # receiver -> replica index
        names = [f"replica r{i} worker {t}" for i, tp in enumerate(replica_tp) for t in range(tp)]
        # a replica joins when the orchestrator gets to it, after the next step's rollouts
        self.sender = ShardedSender(self.rank, len(needs), timeout_s=timeout_s, join_timeout_s=3600.0,
                                    shm=RingShape() if lane == "shm" else None, te=lane == "te", names=names)

    def publish(self, run_dir: Path, version: int) -> dict:
        """Offer `version` (sync/vN/rank{r}.json) and send it once the replicas join; a replica the
        orchestrator writes off (rl_loop.weight_lane) costs only its own lanes."""
        from titan_ext.weights import OwnedReader

        infos = self.sender.update_infos(version)
        write_atomic(sync_dir(run_dir, version) / f"rank{self.rank}.json", lambda t: t.write_text(json.dumps(infos)))
        read = self.reader = OwnedReader(self.model.state_dict(), self.wire_dtype, after=self.reader)
        t0 = time.perf_counter()
        # No cyclic garbage collection while the replicas wait: a full collection over the trainer's
        # heap stalled some sends here by 0.3-0.5 s (the reads of 14.7 MB took 0.02-0.05 s otherwise).
        gc.disable()
        try:
            nbytes = self.sender.send(self.pieces, lambda p: read(self.slices[p.name], p.box),
                                      self.dtypes, self.shapes, version,
                                      gone=lambda k: written_off(run_dir, version, self.replica_of[k]))
        finally:
            gc.enable()
        return {"bytes": nbytes, "send_s": time.perf_counter() - t0, "lanes": sorted(set(self.sender.lanes.values()))}


def die_with_parent() -> None:
    """Make this worker die when its torchrun agent dies (Linux).

    torchrun starts each worker in a session of its own, so a signal to the
    agent's process group (an OOM kill, a user's kill, the orchestrator's
    shutdown after a crash) would leave the worker training on, unsupervised,
    and publishing weights nobody asked for."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    import titan_ext
    from titan_ext.teardown import destroy_process_group_together

    titan_ext.activate()  # the trainer's patches (patches/), before train() imports torchtitan

    train(Path((argv or sys.argv[1:])[0]).resolve())
    # after train() returned: its Trainer, which holds the process groups, is garbage now
    destroy_process_group_together()


def build_trainer(spec: TrainerSpec, run_dir: Path):
    """TorchTitan's trainer for `spec` (model with FSDP2/EP, optimizer, checkpointing), loaded
    from the newest checkpoint under run_dir/trainer, else from spec.init_checkpoint."""
    from titan_ext.checkpoint import read_arch
    from titan_ext.chunked_loss import enable_chunked_loss
    from titan_ext.options import TitanExtOptions, apply_options
    from titan_ext.train_config import trainer_config
    from torchtitan.components.optimizer import default_adamw

    if spec.loss_chunk_tokens:
        enable_chunked_loss()
    cfg = trainer_config(spec.model, spec.flavor)
    arch = read_arch(spec.init_checkpoint, spec.model)
    from titan_ext.models import check_context_parallel, spec_from_arch

    cfg.model_spec = spec_from_arch(spec.model, spec.flavor, arch)
    if spec.context_parallel > 1:
        check_context_parallel(spec.model)
    cfg.parallelism.context_parallel_degree = spec.context_parallel
    apply_options(cfg, TitanExtOptions(dispatcher=spec.dispatcher, fp8=spec.fp8, indexer_fp8=spec.indexer_fp8,
                                       optimizer_offload=spec.optimizer_offload,
                                       activation_offload=spec.activation_offload))
    cfg.hf_assets_path = spec.init_checkpoint
    cfg.dump_folder = str(run_dir / "trainer")
    cfg.training.steps = spec.steps
    # TorchTitan sizes the RoPE cache by training.seq_len; RL sequences (multi-turn ones
    # especially) may be as long as the model allows, not the supervised default of 64.
    cfg.training.seq_len = arch.max_seq_len
    cfg.optimizer = default_adamw(lr=spec.lr, weight_decay=0.0)
    cfg.lr_scheduler.warmup_steps = spec.lr_warmup_steps
    cfg.lr_scheduler.decay_ratio = None  # linear decay over the steps after the warmup
    cfg.checkpoint.enable = True
    cfg.checkpoint.folder = "checkpoint"
    cfg.checkpoint.interval = spec.checkpoint_interval
    cfg.checkpoint.initial_load_path = spec.init_checkpoint
    cfg.checkpoint.initial_load_in_hf = True
    cfg.checkpoint.initial_load_model_only = True
    cfg.checkpoint.last_save_model_only = False
    # Batches come from the run directory, not TorchTitan's dataloader: its state is irrelevant,
    # and excluding it lets a run resume with a different number of trainer processes.
    cfg.checkpoint.exclude_from_loading = ["dataloader"]
    trainer = cfg.build()
    trainer.checkpointer.load()
    # A checkpoint restores the optimizer's rate of the run that saved it; the schedule of this run (whose
    # train.steps or lr may differ on --resume) gives the next step's rate.
    for scheduler in trainer.lr_schedulers:
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    return trainer


def data_parallel_rank(parallel_dims) -> tuple[int, int]:
    """(this rank's index, their number) among the ranks that take different batch rows; the
    context-parallel ranks of one data-parallel rank share its rows, each taking its positions."""
    if not parallel_dims.dp_enabled:
        return 0, 1
    mesh = parallel_dims.get_mesh("batch")
    return mesh.get_local_rank(), mesh.size()


def train(run_dir: Path) -> None:
    """Train the steps of the run in `run_dir`, one batch file at a time, publishing weights after each."""
    from titan_ext.checkpoint import checkpoint_quantization

    spec = TrainerSpec.load(run_dir)
    trainer = build_trainer(spec, run_dir)
    model = trainer.model_parts[0]
    model.train()
    rank = dist.get_rank()
    dp_rank, dp = data_parallel_rank(trainer.parallel_dims)
    loss_config = LossConfig(max_ratio=spec.max_ratio)
    wire_dtype = getattr(torch, spec.wire_dtype)
    quant = checkpoint_quantization(spec.init_checkpoint)  # the replicas serve this checkpoint's format
    publisher = None
    if spec.weight_lane != "fs":
        publisher = ShardedPublisher(model, spec.replica_tp or [], spec.weight_lane, wire_dtype)
    elif trainer.step == 0:
        publish_weights(model, weights_dir(run_dir, 0), 0, wire_dtype, quant)
    while trainer.step < spec.steps:
        step = trainer.step + 1
        path = batch_path(run_dir, step)
        t_wait = time.perf_counter()
        while not path.exists():
            time.sleep(spec.poll_s)
        wait_s = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        batch = Batch.from_dict(torch.load(path, weights_only=False))
        total = int(batch.mask.sum())
        metrics = rl_step(model, batch.shard(dp_rank, dp), loss_config, replay=spec.replay, total_tokens=total,
                          loss_chunk_tokens=spec.loss_chunk_tokens)
        metrics.update(reduce_metrics(metrics, total))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        lr = next(iter(trainer.optimizers)).param_groups[0]["lr"]  # the rate this step applies
        trainer.optimizers.step()
        trainer.lr_schedulers.step()
        trainer.optimizers.zero_grad()
        trainer.step = step
        train_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.checkpointer.save(curr_step=step, last_step=step == spec.steps)
        if publisher is None or step % spec.checkpoint_interval == 0 or step == spec.steps:
            publish_weights(model, weights_dir(run_dir, step), step, wire_dtype, quant)  # also what --resume loads
        publish_s = time.perf_counter() - t1
        if rank == 0:
            grad = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            metrics.update(step=step, grad_norm=float(grad), lr=lr, wait_s=wait_s, train_s=train_s, publish_s=publish_s)
            write_atomic(metrics_path(run_dir, step), lambda tmp: tmp.write_text(json.dumps(metrics)))
        if publisher is not None:  # after the metrics: the orchestrator drives the replicas once it has them
            try:
                sent = publisher.publish(run_dir, step)
                print(f"rank {rank}: v{step} sent over {spec.weight_lane}: {sent}", flush=True)
            except Exception as exc:  # noqa: BLE001 - the replicas keep their version; the orchestrator counts it
                print(f"rank {rank}: v{step} not delivered: {exc}", flush=True)
    trainer.close()


if __name__ == "__main__":
    from titan_ext.teardown import exit_without_finalizing

    main()
    exit_without_finalizing()
