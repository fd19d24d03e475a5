"""`vllm_ext.dsa.ops`: vLLM's fp8 indexer numerics, the causal top-k and sparse latent attention,
against independent formulations (dense attention with a mask, vLLM's scale rule written out)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_ext.dsa import ops


def test_key_scales_are_powers_of_two_that_fit_the_block_in_fp8():
    k = torch.randn(64, 128) * torch.logspace(-6, 3, 64)[:, None]
    k_fp8, scale = ops.quantize_index_keys(k)
    assert k_fp8.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round()), "ue8m0: the scale is a power of two"
    for row, s in zip(k, scale.tolist()):
        expected = 2.0 ** math.ceil(math.log2(max(row.abs().max().item(), 1e-4) / 448.0))
        assert s == expected
    assert (k_fp8.float().abs() <= 448).all()
    rel = ((k_fp8.float() * scale[:, None] - k) / k.abs().amax(-1, keepdim=True)).abs().max()
    assert rel < 2 ** -3, "e4m3 keeps 3 mantissa bits of each value"


def test_rank_keys_is_the_weighted_relu_score_of_the_dequantized_vectors():
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(5, 4, 128, generator=gen), torch.randn(12, 128, generator=gen), torch.randn(5, 4, generator=gen)
    k_fp8, k_scale = ops.quantize_index_keys(k)
    q_fp8, q_scale = ops.quantize_index_queries(q)
    qd, kd = q_fp8.float() * q_scale[..., None], k_fp8.float() * k_scale[:, None]
    scores = (torch.einsum("mhd,nd->mhn", qd, kd).relu() * w[..., None] * 0.125 / 2).sum(1)
    positions = torch.tensor([0, 3, 7, 11, 11])
    got = ops.rank_keys(q, w, k_fp8, k_scale, positions, topk=6, softmax_scale=0.125)
    assert got.dtype == torch.int32 and got.shape == (5, 6)
    for m, p in enumerate(positions.tolist()):
        chosen = [i for i in got[m].tolist() if i >= 0]
        assert len(chosen) == min(6, p + 1) and all(i <= p for i in chosen), "causal, -1 past the earlier keys"
        visible = scores[m, : p + 1]
        assert torch.allclose(visible[chosen], visible.sort(descending=True).values[: len(chosen)], rtol=1e-5)


def test_ties_go_to_the_earlier_key():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    assert ops.causal_topk(logits, torch.tensor([4]), 2).tolist() == [[1, 2]]


def test_sparse_attention_equals_dense_attention_masked_to_the_selected_keys():
    gen = torch.Generator().manual_seed(1)
    m, h, c, v, n = 6, 3, 24, 16, 10
    q, keys = torch.randn(m, h, c, generator=gen), torch.randn(n, c, generator=gen)
    picked = torch.stack([torch.randperm(n, generator=gen)[:4] for _ in range(m)])
    selected = torch.ones(m, 4, dtype=torch.bool)
    selected[0, 2:] = False  # a query with only two keys
    got = ops.sparse_mla_attend(q, keys[picked], selected, 0.3, v)
    mask = torch.full((m, n), float("-inf"))
    for i in range(m):
        mask[i, picked[i][selected[i]]] = 0.0
    probs = torch.softmax(torch.einsum("mhc,nc->mhn", q, keys) * 0.3 + mask[:, None, :], -1)
    assert torch.allclose(got, torch.einsum("mhn,nv->mhv", probs, keys[:, :v]), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_keeps_the_query_dtype(dtype):
    q, kv = torch.randn(2, 2, 8, dtype=dtype), torch.randn(2, 3, 8, dtype=dtype)
    assert ops.sparse_mla_attend(q, kv, torch.ones(2, 3, dtype=torch.bool), 1.0, 4).dtype == dtype


def test_titan_ext_indexer_with_fp8_ranking_selects_what_vllm_selects():
    """The trainer's chunked indexer (running top-k over key chunks) on vLLM's fp8 inputs picks the
    keys `rank_keys` picks, ties included: most keys score 0 for a query whose heads ReLU zeroes."""
    from titan_ext.models.glm5.dsa import indexer_topk

    gen = torch.Generator().manual_seed(2)
    seq, heads, topk = 40, 4, 8
    q, k = torch.randn(seq, heads, 128, generator=gen), torch.randn(seq, 128, generator=gen)
    q[::3] = -q[::3].abs()  # every third query: most keys score exactly 0 after the ReLU
    k = k.abs()
    w = torch.rand(seq, heads, generator=gen)
    k_fp8, k_scale = ops.quantize_index_keys(k)
    want = ops.rank_keys(q, w, k_fp8, k_scale, torch.arange(seq), topk, softmax_scale=128 ** -0.5)
    got = indexer_topk(q[None], k[None], w[None] * heads ** -0.5, topk, [0, 0, seq], 16, 8, 128 ** -0.5, fp8=True)[0]
    for m in range(seq):
        chosen = [i for i in want[m].tolist() if i >= 0]
        assert got[m, : len(chosen)].tolist() == chosen, f"query {m}"


def test_key_sets_compare_as_sets_of_the_keys_a_query_may_see():
    from titan_ext.models.glm5.dsa import key_sets_differ

    a = torch.tensor([[[0, 5, 9], [1, 0, 7], [2, 1, 0]]])  # queries 0..2; a pick past the query is an empty slot
    b = torch.tensor([[[0, 3, 4], [0, 1, 2], [0, 2, 1]]])
    assert key_sets_differ(a, b).tolist() == [[False, False, False]]
    b[0, 2] = torch.tensor([0, 1, 1])
    assert key_sets_differ(a, b).tolist() == [[False, False, True]]
