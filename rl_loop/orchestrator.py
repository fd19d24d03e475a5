"""The async RL loop: rollouts on the replicas, rewards, advantages, batches for the trainer, weight sync.

One step n:
  1. generate: `prompts_per_step` groups of `samples_per_prompt` completions on the
     replicas (through the embedded router), with logprobs and routing records;
  2. score: task rewards, group-relative advantages; pack a batch (samples whose
     routing record is missing or does not fit are rejected and counted, per step
     by reason in metrics.jsonl's `rejected`);
  3. train: the trainer subprocess (TorchTitan) takes the batch and publishes
     weights version n;
  4. sync: every replica loads version n (pause, update, resume).

Off-policy limit: with `max_off_policy_steps` k >= 1 the rollouts of step n+1 are
generated while the trainer trains step n, by policy n-1, i.e. one version
behind the weights they are trained on; that lag never exceeds 1 (<= k). With
k = 0 generation waits for the weights of the previous step (synchronous).
A group whose policy version lags by more than k (a replica whose update
failed, say) is dropped and counted, never trained on silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .advantages import group_advantages
from .batch import Batch, ModelShape, Sample, pack, reason_kind
from .config import RLConfig
from .placement import for_config, format_cpus, pin, trainer_env
from .kv_pool import MooncakeMaster, MooncakePool, connector_args
from .disagg import disagg_metrics, replica_roles, serving_replicas
from .replicas import Replica, checkpoint_context, ttft_totals, served_model_name, start_replica, stop_replica, wait_healthy
from .report import Reporter, log
from .llmd import LlmdRouter
from .router import embedded_pick
from .rollouts import RolloutContext, generate_group, replica_session
from .tasks import get_task, group_samples, is_episodic
from .tools.parsing import DEFAULT_PARSERS, tool_metrics
from .tools.sandbox import SandboxLimits
from vllm_ext.routing.capture import INDEX_KEYS_ENV
from vllm_ext.routing.handoff import sweep_dead_servers
from vllm_ext.transport.client import Replica as ClientReplica, ShardedUpdate, push_fs
from vllm_ext.transport.shm import sweep
from vllm_ext.transport.wire import COMMIT_MARKER

from .run_dir import batch_path, metrics_path, weights_dir, write_atomic
from .trainer import TrainerSpec
from .weight_lane import LaneChoice, choose_lane, read_infos, write_off


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and what to do (`moerl rl` prints it as one line)."""


class TrainerExited(RunStopped):
    """The trainer process ended before the run did (crash, OOM kill, a user's kill)."""


class NoUsableSamples(RunStopped):
    """A step's rollouts were all stale or rejected: there is nothing to train on."""


@dataclass
class Rollouts:
    """The scored groups of one step and what producing them cost."""

    samples: list[Sample]
    generate_s: float
    score_s: float
    counters: dict = field(default_factory=dict)


def push_weights(replica: Replica, path: Path, version: int) -> None:
    """Load committed version `path` into `replica` (pause, update, resume; the old weights stay on failure)."""
    push_fs([replica.base_url], path, version)


class Orchestrator:
    def __init__(self, config: RLConfig, *, resume: bool = False, weight_sync=push_weights):
        self.cfg = config
        self.resume = resume
        self.run_dir = Path(config.run_dir).resolve()
        ro = config.rollout
        sandbox = SandboxLimits(wall_s=ro.tool_wall_s, cpu_s=ro.tool_cpu_s, output_bytes=ro.tool_output_bytes) \
            if ro.tool_sandbox else None
        parser = DEFAULT_PARSERS.get(config.model.arch) if ro.tool_parser == "auto" else ro.tool_parser
        self.task = get_task(ro.task, ro.task_args, chat_format=ro.chat_format, tool_parser=parser, sandbox=sandbox)
        self.rng = random.Random(config.seed)
        self.replicas: list[Replica] = []
        self.trainer_proc: subprocess.Popen | None = None
        self.kv_master: MooncakeMaster | None = None
        self.counters = {"dropped_stale_groups": 0, "rejected_samples": 0, "resent_groups": 0, "failed_syncs": 0}
        self.weight_sync = weight_sync
        self.placement = for_config(config)
        self.lane: LaneChoice | None = None
        inf = config.inference
        self.router = LlmdRouter(inf.llmd_address, retry_for_s=inf.llmd_retry_s) if inf.router == "llmd" else embedded_pick

    # ------------------------------------------------------------------ set-up

    def init_checkpoint(self) -> Path:
        if self.cfg.model.checkpoint:
            return Path(self.cfg.model.checkpoint).resolve()
        from .tiny_models import make_tiny_checkpoint

        return make_tiny_checkpoint(self.cfg.model.arch, self.run_dir / "init", dtype="float32",
                                    init_scale=self.cfg.model.init_scale, seed=self.cfg.seed,
                                    chat_template=self.cfg.model.chat_template or None,
                                    warm_start_steps=self.cfg.model.warm_start_steps)

    def resume_step(self) -> int:
        """The step to continue after: the newest trainer checkpoint whose step was reported and whose
        weights were published (0: start over). Everything newer (checkpoints, batches, weights,
        trainer metrics, the sharded lanes' offers: a dead trainer's senders) is discarded, so
        trainer, replicas and logs all restart from that step."""
        reported = {r["step"] for r in Reporter.read(self.run_dir)}
        ckpt = self.run_dir / "trainer" / "checkpoint"
        steps = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*")) if ckpt.exists() else []
        usable = [n for n in steps if n in reported and (weights_dir(self.run_dir, n) / COMMIT_MARKER).exists()]
        last = usable[-1] if usable else 0
        for path in [*ckpt.glob("step-*"), *(self.run_dir / "batches").glob("step_*.pt"),
                     *(self.run_dir / "weights").glob("v*"), *(self.run_dir / "trainer").glob("metrics_*.json"),
                     *(self.run_dir / "sync").glob("v*")]:
            if _step_of(path.name) > last:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        return last

    def start_trainer(self, init: Path) -> None:
        c = self.cfg
        TrainerSpec.from_config(c, init, self.lane.lane, [c.inference.tensor_parallel] * self.replica_count()
                                ).save(self.run_dir)
        log_file = open(self.run_dir / "trainer.log", "a")
        cores = self.placement.trainer if self.placement else None
        self.trainer_proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(c.train.nproc),
             "-m", "rl_loop.trainer", str(self.run_dir)],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **trainer_env(cores, c.train.nproc)} if cores else None,
            preexec_fn=pin(cores) if cores else None,
        )

    def replica_count(self) -> int:
        c = self.cfg.inference
        return c.replicas or len(c.endpoints)

    def pick_lane(self, init: Path) -> LaneChoice:
        """The weight lane of this run (inference.weight_sync), logged with the reason."""
        from titan_ext.checkpoint import checkpoint_quantization
        from vllm_ext.transport.shm import unsupported_reason

        choice = choose_lane(self.cfg.inference.weight_sync,
                             block_fp8=checkpoint_quantization(str(init)) is not None,
                             shm_problem=unsupported_reason(), managed=self.cfg.inference.replicas > 0)
        log(f"weight sync lane: {choice.lane} ({choice.why})")
        return choice

    def start_replicas(self, version: int, init: Path) -> None:
        c = self.cfg.inference
        if c.replicas == 0:
            self.replicas = [Replica(name=f"r{i}", base_url=u.rstrip("/")) for i, u in enumerate(c.endpoints)]
            if not self.replicas:
                raise ValueError("inference.replicas = 0 needs inference.endpoints")
            return
        kv_args = self.start_kv_pool()
        self.replicas = []
        for i, (name, role) in enumerate(replica_roles(c)):
            extra, env = kv_args(c.base_port + i, role)
            if self.cfg.train.replay_indexer:
                env = {**env, INDEX_KEYS_ENV: "1"}
            self.replicas.append(start_replica(
                name, init, c.base_port + i, self.run_dir / "replicas", dtype=self.cfg.model.inference_dtype,
                max_num_seqs=c.max_num_seqs, kv_cache_gib=c.kv_cache_gib, enforce_eager=c.enforce_eager, extra=extra,
                env=env, cpus=self.placement.replicas[i] if self.placement else None,
                tensor_parallel=c.tensor_parallel))
            self.replicas[-1].role = role
        wait_healthy(self.replicas)
        if version > 0:  # resumed: bring the fresh replicas to the trainer's version
            path = self.wait_for_weights(version)
            for r in self.replicas:
                self.weight_sync(r, path, version)
                r.policy_version = version

    def start_kv_pool(self) -> Callable[[int, str], tuple[list[str], dict[str, str]]]:
        """Start the mooncake_master when the replicas pool KV; (port, role) -> the vLLM arguments and
        environment of the replica serving on that port."""
        c = self.cfg.inference
        if c.kv_pool == "off":
            return lambda port, role: ([], {})
        pool = MooncakePool(host=c.kv_pool_host, rpc_port=c.kv_pool_rpc_port, metrics_port=c.kv_pool_metrics_port,
                            segment_gib=c.kv_pool_segment_gib)
        self.kv_master = MooncakeMaster(pool, self.run_dir / "kv_pool")
        self.kv_master.start()
        return lambda port, role: connector_args(pool, self.kv_master.config_path, port, role)

    # ------------------------------------------------------------------ per step

    async def rollouts(self, session, tokenizer, model_name: str, step: int) -> Rollouts:
        """The step's rollouts, and the mean time to first token the sampling replicas saw meanwhile
        (vLLM's own histogram; under disaggregation the decode half's, after `prefill_s`)."""
        serving = [r for r in serving_replicas(self.replicas) if r.up]
        before = await ttft_totals(session, serving)
        ro = await self._rollouts(session, tokenizer, model_name, step)
        after = await ttft_totals(session, serving)
        if before is not None and after is not None and after[1] > before[1]:
            ro.counters["ttft_s"] = (after[0] - before[0]) / (after[1] - before[1])
        return ro

    async def _rollouts(self, session, tokenizer, model_name: str, step: int) -> Rollouts:
        c = self.cfg.rollout
        prompts = self.task.prompts(self.rng, c.prompts_per_step)
        counters = {"resent_groups": 0}
        t0 = time.perf_counter()
        if is_episodic(self.task):  # multi-turn tasks and verifiers environments play (and score) whole groups
            ctx = RolloutContext(session, self.replicas, self.router, model_name, tokenizer, c.max_tokens,
                                 c.temperature, self.cfg.inference.request_timeout_s, counters)
            seeds = [self.cfg.seed * 100003 + step * 1009 + i for i in range(len(prompts))]
            groups = await asyncio.gather(*(self.task.run_group(ctx, p, c.samples_per_prompt, f"{step}-{i}", seeds[i])
                                            for i, p in enumerate(prompts)))
            score_s = counters.pop("score_s", 0.0)
            samples = [s for g, episodes in enumerate(groups) for s in group_samples(episodes, g)]
            return Rollouts(samples, time.perf_counter() - t0 - score_s, score_s, counters)

        async def one(i, prompt):
            ids = tokenizer(prompt.text).input_ids
            completions, replica = await generate_group(
                session, self.replicas, self.router, model_name, ids, f"{step}-{i}", counters,
                n=c.samples_per_prompt, max_tokens=c.max_tokens, temperature=c.temperature,
                seed=self.cfg.seed * 100003 + step * 1009 + i, timeout_s=self.cfg.inference.request_timeout_s,
            )
            # Syncs never overlap rollouts, so the replica's version now is the one that generated.
            return prompt, ids, completions, replica.policy_version

        groups = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        t1 = time.perf_counter()
        samples = []
        for g, (prompt, ids, completions, version) in enumerate(groups):
            for comp in completions:
                reward = self.task.reward(prompt, tokenizer.decode(comp.completion_ids))
                samples.append(Sample(ids, comp.completion_ids, comp.logprobs, reward, g, version, comp.routing,
                                      routing_error=comp.routing_error, index_keys=comp.index_keys))
        return Rollouts(samples, t1 - t0, time.perf_counter() - t1, counters)

    def build_batch(self, rollouts: Rollouts, step: int, shape: ModelShape | None,
                    pad_id: int) -> tuple[Batch | None, list[Sample], dict[str, int]]:
        """The step's batch (None if no sample is left), its samples, and rejected samples counted by reason kind."""
        k = self.cfg.rollout.max_off_policy_steps
        fresh = [s for s in rollouts.samples if step - 1 - s.policy_version <= k]
        stale_groups = {s.group for s in rollouts.samples} - {s.group for s in fresh}
        self.counters["dropped_stale_groups"] += len(stale_groups)
        groups = sorted({s.group for s in fresh})
        n = self.cfg.rollout.samples_per_prompt
        rewards = torch.tensor([[s.reward for s in fresh if s.group == g] for g in groups])
        adv = group_advantages(rewards, normalize_std=self.cfg.train.normalize_std) if groups else rewards
        for gi, g in enumerate(groups):
            for j, s in enumerate([s for s in fresh if s.group == g][:n]):
                s.advantage = float(adv[gi, j])
        batch, rejected = pack(fresh, shape if self.cfg.train.replay else None, pad_id)
        for idx, reason in rejected:
            log(f"step {step}: sample {idx} rejected: {reason}")
        self.counters["rejected_samples"] += len(rejected)
        return batch, fresh, dict(Counter(reason_kind(reason) for _, reason in rejected))

    def check_trainer(self, waiting_for: str) -> None:
        if self.trainer_proc is not None and self.trainer_proc.poll() is not None:
            raise TrainerExited(f"trainer exited ({self.trainer_proc.returncode}) before {waiting_for}; see "
                                f"{self.run_dir}/trainer.log, then continue with --resume")

    def wait_for_weights(self, version: int, timeout_s: float = 3600.0) -> Path:
        path = weights_dir(self.run_dir, version)
        deadline = time.time() + timeout_s
        while not (path / COMMIT_MARKER).exists():
            self.check_trainer(f"publishing weights v{version}")
            if time.time() > deadline:
                raise TimeoutError(f"weights v{version} not published after {timeout_s:.0f}s")
            time.sleep(0.05)
        return path

    async def wait_for_metrics(self, step: int) -> dict:
        path = metrics_path(self.run_dir, step)
        while not path.exists():
            self.check_trainer(f"finishing step {step}")
            await asyncio.sleep(0.05)
        if self.lane is None or self.lane.lane == "fs":
            self.wait_for_weights(step)
        return json.loads(path.read_text())

    def begin_sharded(self, version: int) -> tuple[ShardedUpdate, list[int]]:
        """The first half of a sharded sync (``ShardedUpdate.begin``): every live replica starts
        receiving `version` from every trainer rank while it serves on. A replica out of
        rotation, or whose update fails, is written off for the trainer ranks at once (their
        lanes to it stop waiting); the others finish, as with the filesystem lane."""
        infos = read_infos(self.run_dir, version, self.cfg.train.nproc,
                           alive=lambda: self.check_trainer(f"offering weights v{version}"))
        live = [i for i, r in enumerate(self.replicas) if r.up]
        for i in sorted(set(range(len(self.replicas))) - set(live)):
            write_off(self.run_dir, version, i, f"replica {self.replicas[i].name} is out of rotation")
        tp = self.cfg.inference.tensor_parallel  # infos[rank]: every replica's workers in turn
        workers = [[[infos[rank][i * tp + t] for rank in range(len(infos))] for t in range(tp)] for i in live]

        def lost(k: int, why: str) -> None:
            r = self.replicas[live[k]]
            log(f"weight sync of {r.name} to v{version} over {self.lane.lane} failed, it keeps "
                f"v{r.policy_version}: {why}")
            write_off(self.run_dir, version, live[k], f"replica {r.name}: {why}")

        update = ShardedUpdate([self.replicas[i].base_url for i in live], workers, version, lost=lost,
                               answer_within_s=self.cfg.inference.weight_sync_timeout_s)
        update.begin()
        return update, live

    def swap_sharded(self, update: ShardedUpdate, live: list[int]) -> None:
        """The second half: every replica that began pauses, applies and resumes."""
        version = update.version
        for i in live:
            self.replicas[i].updating = True
        try:
            update.swap()
            for i in live:
                self.replicas[i].policy_version = version
        except Exception as exc:  # noqa: BLE001 - a failed replica keeps serving its old weights
            self.counters["failed_syncs"] += 1
            log(f"weight sync to v{version} over {self.lane.lane} failed: {exc}")
            for k in getattr(exc, "hung", []):
                r = self.replicas[live[k]]
                r.up = False
                log(f"replica {r.name}: its update to v{version} did not answer within "
                    f"{self.cfg.inference.weight_sync_timeout_s:.0f} s: out of rotation")
            for i in live:  # the ones that did update say so
                if self.replicas[i].up:
                    with contextlib.suppress(Exception):
                        self.replicas[i].policy_version = int(ClientReplica(self.replicas[i].base_url).version())
        finally:
            for i in live:
                self.replicas[i].updating = False

    def begin_sync(self, version: int) -> asyncio.Task | None:
        """On a sharded lane, the transfer of `version` starting now, in the background (the
        replicas serve on: the rollouts still running finish meanwhile); None on the filesystem lane."""
        if self.lane is None or self.lane.lane == "fs":
            return None
        return asyncio.create_task(asyncio.to_thread(self.begin_sharded, version))

    async def sync(self, version: int, begun: asyncio.Task | None) -> float:
        """Every live replica loads `version`; a failed update leaves it on its old version (counted).
        The seconds it kept the step waiting: with the transfer ``begin_sync`` started (a sharded
        lane), for the rest of it and for the swap."""
        t0 = time.perf_counter()
        if begun is not None:
            update, live = await begun
            await asyncio.to_thread(self.swap_sharded, update, live)
            return time.perf_counter() - t0
        path = weights_dir(self.run_dir, version)
        for r in [r for r in self.replicas if r.up]:
            r.updating = True
            try:
                await asyncio.to_thread(self.weight_sync, r, path, version)
                r.policy_version = version
            except Exception as exc:  # noqa: BLE001 - any failure: keep serving the old weights
                self.counters["failed_syncs"] += 1
                log(f"weight sync of {r.name} to v{version} failed, it keeps v{r.policy_version}: {exc}")
            finally:
                r.updating = False
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the loop

    async def run(self) -> dict:
        from transformers import AutoTokenizer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = self.resume_step() if self.resume else 0
        if not self.resume and (self.run_dir / "trainer").exists():
            raise FileExistsError(f"{self.run_dir} holds a previous run: use --resume or another run_dir")
        init = self.init_checkpoint()
        tokenizer = AutoTokenizer.from_pretrained(str(init))
        from titan_ext.checkpoint import checkpoint_tensors, read_arch

        arch = read_arch(init, self.cfg.model.arch)
        checkpoint_tensors(init)  # every shard's header: a damaged or missing file stops the run here
        context = checkpoint_context(init)
        if self.cfg.rollout.max_tokens >= context:  # refused before the trainer or any server starts
            raise ValueError(f"rollout.max_tokens {self.cfg.rollout.max_tokens} leaves no room for a prompt in the "
                             f"checkpoint's context of {context} tokens (max_position_embeddings in "
                             f"{init / 'config.json'}); lower rollout.max_tokens below {context}")
        if self.cfg.train.replay_indexer and not arch.has_indexer:
            raise ValueError(f"train.replay_indexer = true, but {init} has no DSA indexer (GLM-5 has); "
                             "set train.replay_indexer = false")
        shape = ModelShape.of(arch, index_keys=self.cfg.train.replay_indexer)
        reporter = Reporter(self.run_dir, resume_step=start)
        self.lane = self.pick_lane(init)
        if self.placement:
            log(f"cores: trainer {format_cpus(self.placement.trainer)}, replicas "
                + " | ".join(format_cpus(c) for c in self.placement.replicas))
        self.start_trainer(init)
        try:
            self.start_replicas(start, init)
            if self.placement:  # HTTP, scoring and batching run beside the replicas, off the trainer's cores
                os.sched_setaffinity(0, {c for cores in self.placement.replicas for c in cores})
            model_name = await asyncio.to_thread(served_model_name, self.replicas[0])
            k = self.cfg.rollout.max_off_policy_steps
            inf_llmd = isinstance(self.router, LlmdRouter)
            async with replica_session() as session:
                last = self.cfg.train.steps
                submitted: dict[int, tuple[Rollouts, list[Sample], dict[str, int]]] = {}

                async def submit(step: int) -> None:
                    """Generate step's rollouts on the replicas as they are now, and hand the batch to the trainer."""
                    ro = await self.rollouts(session, tokenizer, model_name, step)
                    self.counters["resent_groups"] += ro.counters.get("resent_groups", 0)
                    batch, fresh, rejected = self.build_batch(ro, step, shape, tokenizer.pad_token_id)
                    if batch is None:
                        versions = {r.name: r.policy_version for r in self.replicas}
                        raise NoUsableSamples(
                            f"step {step}: no usable samples. Rejected by reason: {rejected}; stale (generated "
                            f"more than rollout.max_off_policy_steps={k} versions behind v{step - 1}): "
                            f"{sum(step - 1 - s.policy_version > k for s in ro.samples)} of {len(ro.samples)}, "
                            f"replica versions {versions}, failed weight syncs {self.counters['failed_syncs']} "
                            f"(their errors are above). Fix what failed, then continue with --resume")
                    write_atomic(batch_path(self.run_dir, step), lambda t: torch.save(batch.to_dict(), t))
                    submitted[step] = (ro, fresh, rejected)

                await submit(start + 1)
                for step in range(start + 1, last + 1):
                    t_step = time.perf_counter()
                    # Async: step+1 is generated by the weights the replicas hold now (one version
                    # behind the trainer) while the trainer trains `step`, and handed over the moment
                    # both are done, so the trainer never waits for the weight sync below.
                    ahead = asyncio.create_task(submit(step + 1)) if k >= 1 and step < last else None
                    t_wait = time.perf_counter()
                    try:
                        metrics = await self.wait_for_metrics(step)
                    except BaseException:
                        if ahead is not None:  # its requests would outlive the session
                            ahead.cancel()
                            await asyncio.gather(ahead, return_exceptions=True)
                        raise
                    wait_s = time.perf_counter() - t_wait
                    begun = self.begin_sync(step)
                    try:
                        if ahead is not None:
                            await ahead
                    except BaseException:
                        if begun is not None:
                            await asyncio.gather(begun, return_exceptions=True)
                        raise
                    sync_s = await self.sync(step, begun)
                    if k == 0 and step < last:
                        await submit(step + 1)
                    ro, fresh, rejected = submitted.pop(step)
                    reporter.step({
                        "step": step, "reward": sum(s.reward for s in fresh) / len(fresh),
                        "k3_mean": metrics["mismatch_k3_mean"], "k3_max": metrics["mismatch_k3_max"],
                        "extreme_frac": metrics["extreme_frac"], "masked_frac": metrics["masked_frac"],
                        "entropy": metrics["entropy_mean"],
                        "router_disagreement": metrics.get("router_disagreement"), "loss": metrics["loss"],
                        **({"indexer_disagreement": metrics.get("indexer_disagreement")}
                           if self.cfg.train.replay_indexer else {}),
                        "gen_s": ro.generate_s, "score_s": ro.score_s, "train_s": metrics["train_s"],
                        "sync_s": sync_s, "wait_s": wait_s, "trainer_wait_s": metrics["wait_s"],
                        "step_s": time.perf_counter() - t_step, "samples": len(fresh),
                        "rejected": rejected,
                        "policy_lag": step - 1 - min(s.policy_version for s in fresh),
                        "ttft_s_mean": ro.counters.get("ttft_s"),
                        **tool_metrics(ro.counters),
                        **(disagg_metrics(ro.counters) if self.cfg.inference.prefill_replicas else {}),
                        "replica_versions": {r.name: r.policy_version for r in self.replicas if r.up},
                        **{f"total_{name}": v for name, v in self.counters.items()},
                        **({"total_router_backoffs": self.router.backoffs} if inf_llmd else {}),
                    })
            if inf_llmd:
                await self.router.close()
            if self.trainer_proc is not None:
                self.trainer_proc.wait(600)
        finally:
            for r in self.replicas:
                stop_replica(r)
            sweep_dead_servers()  # the routing segments of a replica killed under the run
            if self.kv_master is not None:
                self.kv_master.stop()
            if self.trainer_proc is not None and self.trainer_proc.poll() is None:
                os.killpg(self.trainer_proc.pid, signal.SIGTERM)
                self.trainer_proc.wait(60)
            if self.lane is not None and self.lane.lane == "shm":
                sweep()  # a trainer stopped by a signal could not unlink its rings
        png = reporter.close()
        summary = {"run_dir": str(self.run_dir), "metrics": str(reporter.jsonl), "plot": str(png) if png else None,
                   "tensorboard": str(self.run_dir / "tensorboard"), **self.counters}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _step_of(name: str) -> int:
    """The step number in `step-12`, `step_000012.pt`, `v000012`, `metrics_000012.json`."""
    return int("".join(ch for ch in name.split(".")[0] if ch.isdigit()) or 0)
