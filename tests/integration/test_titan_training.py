"""TorchTitan with titan_ext on gloo, several processes: FSDP2, FSDP2 + expert parallel 2."""

import math
import os
import re
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, VENV_BIN, losses_from_log, run_torchrun, two_at_a_time

TORCHTITAN = str(VENV_BIN / "torchtitan")


# The worker's flag sets per (model, EP degree) the tests below need: one torchrun run computes them all.
WORKER_VARIANTS = {("kimi_k2", 1): ("",), ("kimi_k2", 2): ("", "--replay"), ("glm5", 1): ("",), ("glm5", 2): ("",)}


@pytest.fixture(scope="module")
def worker_logits(tiny_checkpoint, tmp_path_factory):
    """worker_logits(model, ep, flags="") -> the worker's logits of the fixed batch (init scale 0.1)."""
    out_dir = tmp_path_factory.mktemp("ep_logits")
    cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def run(model: str, ep: int, flags: str = "") -> torch.Tensor:
        if (model, ep) not in cache:
            variants = WORKER_VARIANTS[model, ep]
            out = out_dir / f"{model}_ep{ep}.pt"
            proc = run_torchrun(ep, str(ROOT / "tests/integration/ep_logits_worker.py"),
                                str(tiny_checkpoint(model, 0.1)), model, str(ep), str(out), *variants)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[model, ep] = dict(zip(variants, torch.load(out), strict=True))
        return cache[model, ep][flags]

    return run


@pytest.mark.parametrize("model", ["kimi_k2", "glm5"])
def test_expert_parallel_2_gives_the_same_logits_as_ep_1(worker_logits, model):
    ep1, ep2 = worker_logits(model, 1), worker_logits(model, 2)
    assert ep1.shape == ep2.shape and ep1.abs().max() > 0.1
    assert (ep1 - ep2).abs().max().item() <= 1e-5


def test_replayed_loss_under_fsdp2_and_ep2_equals_single_process(tiny_checkpoint, worker_logits):
    from tests.integration.ep_logits_worker import fixed_batch
    from titan_ext.checkpoint import load_hf_checkpoint
    from titan_ext.replay import moe_routers, replay_routing

    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    tokens, ids = fixed_batch(arch.vocab_size, len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    with torch.no_grad(), replay_routing(model, ids) as routers:
        single = model(tokens)
    assert min(r.disagreement for r in moe_routers(model) if r.disagreement is not None) > 0.9
    assert len(routers) == len(arch.moe_layer_ids)
    distributed = worker_logits("kimi_k2", 2, "--replay")

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    with torch.no_grad():
        own = model(tokens)
    assert (single - distributed).abs().max().item() <= 1e-5
    assert abs(loss(single).item() - loss(distributed).item()) <= 1e-6
    assert (own - single).abs().max().item() > 1e-2, "the random record really changed the routing"


def _train(tmp_path, nproc, *flags):
    proc = run_torchrun(
        nproc, TORCHTITAN, "train", "--extension", "titan_ext", "--model", "kimi_k2", "--flavor", "tiny",
        "--dump_folder", str(tmp_path), *flags,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses_from_log(proc.stdout + proc.stderr)


def test_twenty_steps_with_expert_parallel_2_reduce_loss(tmp_path):
    losses = _train(tmp_path, 2, "--training.steps", "20", "--parallelism.expert_parallel_degree", "2")
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_fsdp_two_processes_reduce_loss_with_whole_or_chunked_logits_and_offloaded_moments(tmp_path):
    """`--titan_ext.loss_chunks 3` (TorchTitan's ChunkedLossWrapper: LM head and cross-entropy on thirds of
    each 63-token sequence) trains as whole-sequence logits do: the same losses, to the log's 4 decimals at
    step 1 and within 1e-3 after AdamW has amplified the first steps' last-bit differences.
    `--titan_ext.optimizer_offload` with `--titan_ext.activation_offload` under full AC (AdamW's moments and each
    block's checkpointed input off the device between their uses) changes no bit."""
    flags = ("--training.steps", "10", "--training.seq_len", "63", "--debug.seed", "0")  # the same initial weights
    losses = _train(tmp_path / "whole", 2, *flags)
    chunked = _train(tmp_path / "chunked", 2, *flags, "--titan_ext.loss_chunks", "3")
    offloaded = _train(tmp_path / "offloaded", 2, *flags, "--titan_ext.optimizer_offload", "--titan_ext.activation_offload",
                       "activation-checkpoint:full")
    assert offloaded == losses
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
    assert abs(chunked[0] - losses[0]) <= 1e-4 and max(abs(a - b) for a, b in zip(chunked, losses)) <= 1e-3, (
        chunked, losses)


# The README's command, `torchtitan train --extension titan_ext --model M --flavor tiny`, for every
# model the README names, on every topology (one process; torchrun x2 with FSDP2; torchrun x2 with
# FSDP2 + EP=2) and under every activation-checkpointing mode TorchTitan offers. Not the full cross
# product (each run costs a process start): every model runs every topology and every AC mode, the
# default (selective) on one process (under torchrun the loss tests above run it for Kimi-K2, and
# test_context_parallel.py's CLI run for GLM-5); full and none each run under torchrun.
# memory-budget needs a compiled model: aot_eager_decomp_partition runs the budgeted partitioner
# without inductor's C++ build.
TOPOLOGIES = {"single": (1, []), "fsdp2": (2, []), "ep2": (2, ["--parallelism.expert_parallel_degree", "2"])}
AC_FLAGS = {  # after every other flag: tyro parses flags after a subcommand as the subcommand's
    "selective": [],  # TorchTitan's default
    "full": ["activation-checkpoint:full"],
    "none": ["activation-checkpoint:none"],
    "memory-budget": ["--compile.enable", "--compile.backend", "aot_eager_decomp_partition",
                      "activation-checkpoint:memory-budget"],
}
AC_LOG = {"selective": "Applied SelectiveAC activation checkpointing", "full": "Applied FullAC activation checkpointing",
          "none": None, "memory-budget": "Selected 0.5 budget option"}
CLI_CASES = [
    ("glm5", "single", "selective"), ("glm5", "fsdp2", "full"), ("glm5", "ep2", "none"),
    ("glm5", "single", "memory-budget"),
    ("kimi_k2", "single", "selective"), ("kimi_k2", "fsdp2", "full"), ("kimi_k2", "ep2", "none"),
    ("kimi_k2", "single", "memory-budget"),
    ("qwen3_moe", "single", "selective"), ("qwen3_moe", "fsdp2", "none"), ("qwen3_moe", "ep2", "full"),
    ("qwen3_moe", "single", "memory-budget"),
]


def test_cli_cases_cover_every_model_topology_and_ac_mode():
    for model in ("glm5", "kimi_k2", "qwen3_moe"):
        assert {t for m, t, _ in CLI_CASES if m == model} == set(TOPOLOGIES), model
        assert {a for m, _, a in CLI_CASES if m == model} == set(AC_FLAGS), model
        assert (model, "single", "selective") in CLI_CASES


def _run_cli_case(dump: Path, model: str, topology: str, ac: str) -> subprocess.CompletedProcess:
    nproc, parallel_flags = TOPOLOGIES[topology]
    args = [TORCHTITAN, "train", "--extension", "titan_ext", "--model", model, "--flavor", "tiny",
            "--training.steps", "3", "--dump_folder", str(dump), *parallel_flags, *AC_FLAGS[ac]]
    if nproc > 1:
        return run_torchrun(nproc, *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets it for each of its processes
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def cli_runs(request, tmp_path_factory):
    """The selected CLI_CASES' commands, two at a time in the background from the first test that
    asks (TorchTitan's 2 s pause at the end of a run leaves a core idle too)."""
    selected = [tuple(item.callspec.params[k] for k in ("model", "topology", "ac")) for item in request.session.items
                if getattr(item, "originalname", None) == "test_torchtitan_cli_trains"]
    with two_at_a_time({case: partial(_run_cli_case, tmp_path_factory.mktemp("cli"), *case)
                        for case in selected}) as runs:
        yield runs


@pytest.mark.parametrize("model,topology,ac", CLI_CASES, ids=["-".join(c) for c in CLI_CASES])
def test_torchtitan_cli_trains(cli_runs, model, topology, ac):
    proc = cli_runs[model, topology, ac].result()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    losses = losses_from_log(log)
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses
    applied = re.findall(r"Applied \w+ activation checkpointing|Selected [\d.]+ budget option", log)
    assert set(applied) == ({AC_LOG[ac]} if AC_LOG[ac] else set()), applied
