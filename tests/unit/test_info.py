import json

from tests.conftest import run_moerl
from titan_ext.info import model_info


def _moerl(*args):
    out = run_moerl(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_kimi_k2_full_matches_public_figures():
    info = _moerl("info", "--model", "kimi_k2", "--flavor", "full", "--json")
    assert abs(info["total_params"] / 1.04e12 - 1) <= 0.03
    assert abs(info["active_params"] / 32e9 - 1) <= 0.03


def test_glm5_full_matches_public_figures():
    info = _moerl("info", "--model", "glm5", "--flavor", "full", "--json")
    assert abs(info["total_params"] / 744e9 - 1) <= 0.03
    assert abs(info["active_params"] / 40e9 - 1) <= 0.05


def test_active_counts_top_k_of_the_routed_experts():
    i = model_info("kimi_k2", "tiny")
    dense = i.total_params - i.routed_expert_params
    assert i.active_params == dense + i.routed_expert_params * i.top_k // i.num_experts
