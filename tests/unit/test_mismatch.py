"""rl_loop.mismatch's measurement, with the trainer model itself standing in for the inference engine."""

from __future__ import annotations

import torch

from rl_loop.batch import ModelShape, Sample
from rl_loop.mismatch import bf16_params_copy, default_prompts, measure
from titan_ext.checkpoint import load_hf_checkpoint
from titan_ext.replay import moe_routers


def _self_samples(model, arch, n=6, prompt=5, completion=7, index_keys=False):
    """Token sequences with the model's own fp32 logprobs and routing as the 'inference' side (and, with
    `index_keys`, its indexer's keys as a record carries them: key positions, -1 past the query)."""
    from titan_ext.models.glm5.dsa import recorded_selections

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        p = prompt + i % 2  # two lengths: two padding-free groups
        tokens = torch.randint(3, arch.vocab_size, (1, p + completion), generator=gen)
        own = []
        hooks = [r.register_forward_hook(lambda m, a, o: own.append(o[1])) for r in moe_routers(model)]
        with torch.no_grad(), recorded_selections(model) as picks:
            logits = model(tokens[:, :-1])
        for h in hooks:
            h.remove()
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[0, :, 0]
        routing = torch.stack(own, dim=2)[0].numpy()  # [p + c - 1, L, K]
        keys = None
        if index_keys:
            keys = torch.stack(picks, dim=2)[0]  # [p + c - 1, L, topk]
            keys = torch.where(keys <= torch.arange(keys.size(0))[:, None, None], keys, -1).numpy()
        samples.append(Sample(prompt_ids=tokens[0, :p].tolist(), completion_ids=tokens[0, p:].tolist(),
                              logprobs=logp[p - 1:].tolist(), reward=0.0, group=i, routing=routing,
                              index_keys=keys))
    return samples


def test_trainer_against_itself_has_no_mismatch_and_a_positive_floor(tiny_checkpoint):
    model, arch = load_hf_checkpoint(tiny_checkpoint("qwen3_moe", 0.1), "qwen3_moe")
    shape = ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    samples = _self_samples(model, arch)
    figures, used = measure(model, samples, shape, pad_id=2, batch_size=2)
    assert used == len(samples) and figures["num_rejected"] == 0
    assert figures["num_completion_tokens"] == 6 * 7
    for mode in ("no_replay", "replay"):
        m = figures[mode]
        assert m["kl_max"] < 1e-9 and m["extreme_frac"] == 0.0, (mode, m)
        assert m["router_disagreement"] == [0.0] * shape.num_moe_layers and m["tokens_any_layer_differs"] == 0.0
    assert figures["replay"]["router_disagreement_titan_ext"] == [0.0] * shape.num_moe_layers
    assert figures["floor"]["kl_mean"] > 0.0  # bf16 parameters change the numbers


def test_foreign_routing_is_counted_and_replayed(tiny_checkpoint):
    model, arch = load_hf_checkpoint(tiny_checkpoint("qwen3_moe", 0.1), "qwen3_moe")
    shape = ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    samples = _self_samples(model, arch, n=2)
    for s in samples:  # the 'engine' routed layer 1 of every token elsewhere
        s.routing = s.routing.copy()
        s.routing[:, 1, :] = (s.routing[:, 1, :] + 1) % arch.num_experts
    figures, _ = measure(model, samples, shape, pad_id=2, batch_size=4)
    nr, r = figures["no_replay"], figures["replay"]
    assert nr["router_disagreement"][1] == 1.0 and nr["router_disagreement"][0] == 0.0
    assert nr["tokens_any_layer_differs"] == 1.0
    # Replay uses the foreign experts, so the trainer's outputs move away from the self-consistent logprobs...
    assert r["kl_mean"] > 0.0 and nr["kl_max"] < 1e-9
    # ...and its own choice inside the pass still differs at layer 1, as titan_ext.replay counts it.
    assert r["router_disagreement"][1] == r["router_disagreement_titan_ext"][1] == 1.0


def test_bf16_twin_keeps_complex_buffers(tiny_checkpoint):
    model, _ = load_hf_checkpoint(tiny_checkpoint("kimi_k2", 0.02), "kimi_k2")
    twin = bf16_params_copy(model)
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters())
    complex_buffers = [(n, b) for n, b in twin.named_buffers() if b.is_complex()]
    assert complex_buffers, "expected TorchTitan's ComplexRoPE freqs_cis"
    ref = dict(model.named_buffers())
    assert all(torch.equal(b, ref[n]) for n, b in complex_buffers)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is untouched


def test_default_prompts_are_distinct_and_seeded():
    a = default_prompts(64, 0)
    assert len(set(a)) == 64 and a == default_prompts(64, 0) and a != default_prompts(64, 1)


def test_a_dsa_model_gets_the_fp8_indexer_row_and_its_key_set_differences(tiny_checkpoint):
    """The sampler stand-in ranks keys with vLLM's fp8 numerics (the trainer with `indexer_fp8`):
    the fp8-indexer row is exact, the model-dtype rows are not, and their key sets differ."""
    from titan_ext.models.glm5.dsa import set_indexer_fp8_ranking

    ckpt = tiny_checkpoint("glm5", 0.1)
    sampler, arch = load_hf_checkpoint(ckpt, "glm5", indexer_fp8=True)
    samples = _self_samples(sampler, arch, n=4, prompt=24, completion=12)
    model, _ = load_hf_checkpoint(ckpt, "glm5")
    figures, _ = measure(model, samples, ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts),
                         pad_id=2, batch_size=2)
    assert figures["replay_indexer_fp8"]["kl_max"] < 1e-9 < figures["replay"]["kl_max"]
    differ = figures["indexer_keys_differ"]
    assert 0.0 < differ["model_dtype"] < 1.0 and 0.0 <= differ["bf16_twin"] < 1.0
    assert set_indexer_fp8_ranking(model, False) == arch.n_layers  # every layer has an indexer


def test_replaying_the_samplers_indexer_keys_removes_what_the_fp8_ranking_cannot(tiny_checkpoint):
    """The sampler stand-in ranks keys in fp32 and its samples carry the keys it chose: the trainer ranking
    in fp8 picks other keys for some tokens, replaying the carried keys is exact (the fourth row), and the
    floor is then fp32 against bf16 with the same keys."""
    ckpt = tiny_checkpoint("glm5", 0.1)
    sampler, arch = load_hf_checkpoint(ckpt, "glm5")
    samples = _self_samples(sampler, arch, n=4, prompt=24, completion=12, index_keys=True)
    model, _ = load_hf_checkpoint(ckpt, "glm5")
    shape = ModelShape.of(arch, index_keys=True)
    figures, used = measure(model, samples, shape, pad_id=2, batch_size=2)
    assert used == 4 and figures["num_rejected"] == 0
    assert figures["replay_indexer"]["kl_max"] < 1e-9 < figures["replay_indexer_fp8"]["kl_max"]
    assert 0.0 < figures["indexer_keys_differ"]["matched_vs_served"] < 1.0
    assert figures["floor"]["kl_mean"] > 0.0
