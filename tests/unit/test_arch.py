import pytest

from titan_ext.models import ARCHS, UnknownModelError, arch_from_hf_config, get_arch
from titan_ext.models.arch import MLAMoEArch


@pytest.mark.parametrize("model,flavor", [(m, f) for m in ARCHS for f in ARCHS[m]])
def test_hf_config_round_trip(model, flavor):
    arch = get_arch(model, flavor)
    assert type(arch).from_hf_config(arch.to_hf_config()) == arch
    assert arch_from_hf_config(arch.to_hf_config()) == arch


def test_real_configs_are_what_the_issue_specifies():
    k = get_arch("kimi_k2", "full")
    assert (k.n_layers, k.n_dense_layers, k.dim, k.n_heads, k.num_experts, k.top_k) == (61, 1, 7168, 64, 384, 8)
    assert (k.q_lora_rank, k.kv_lora_rank, k.qk_nope_head_dim, k.qk_rope_head_dim, k.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (k.vocab_size, k.route_scale, k.n_group, k.dense_hidden_dim) == (163840, 2.827, 1, 18432)
    g = get_arch("glm5", "full")
    assert (g.n_layers, g.n_dense_layers, g.dim, g.num_experts, g.top_k, g.route_scale) == (78, 3, 6144, 256, 8, 2.5)
    assert (g.q_lora_rank, g.qk_nope_head_dim, g.v_head_dim, g.vocab_size) == (2048, 192, 256, 154880)
    assert (g.index_n_heads, g.index_head_dim, g.index_topk) == (32, 128, 2048)


def test_unknown_model_and_flavor_list_what_exists():
    with pytest.raises(UnknownModelError, match="kimi_k2"):
        get_arch("llama9", "full")
    with pytest.raises(UnknownModelError, match="full, tiny"):
        get_arch("glm5", "huge")


def test_unsupported_hf_configs_are_refused_with_the_reason():
    cfg = get_arch("kimi_k2", "tiny").to_hf_config()
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        MLAMoEArch.from_hf_config({**cfg, "architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ValueError, match="mscale"):
        MLAMoEArch.from_hf_config({**cfg, "rope_parameters": {**cfg["rope_parameters"], "mscale": 0.7}})
    with pytest.raises(ValueError, match="sigmoid"):
        MLAMoEArch.from_hf_config({**cfg, "scoring_func": "softmax"})
