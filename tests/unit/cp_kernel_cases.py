"""Cases: the context-parallel Triton paths against the torch paths they replace on CUDA.

Not collected on its own: `test_triton_interpreter.py` runs this file under Triton's interpreter on CPU
(fresh process), `benchmarks.gpu_check` on a CUDA GPU (`kernel_device.py`), fp32 against the torch
paths on the CPU, with the bounds `sparse_mla_kernel_cases.py` explains. A rank's queries sit at
head-tail positions of a longer sequence whose keys are all present, as under CP=2.
"""

import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

import titan_ext.models.glm5.indexer_triton as it  # noqa: E402
import titan_ext.models.glm5.sparse_mla_triton as smt  # noqa: E402
from tests.unit.kernel_device import on_device  # noqa: E402
from titan_ext.models.context_parallel import segment_positions  # noqa: E402
from titan_ext.models.glm5.dsa import _index_scores, _SparseLatentAttention, indexer_topk  # noqa: E402
from vllm_ext.dsa import ops  # noqa: E402

# rank 1 of CP=2 on 96 tokens: chunks 1 and 2 of 4
SEGMENTS, SEQ = [0, 24, 24, 24, 48, 24], 96


def _rel(a, b):
    a = a.detach().cpu()
    return ((a - b).norm() / b.norm()).item()


def test_index_scores_kernel_matches_torch():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 70, 3, 32, generator=gen)
    k = torch.randn(2, 90, 32, generator=gen)
    w = torch.randn(2, 70, 3, generator=gen)
    ref = _index_scores(q, k, w, 100, 60, 0.2)  # queries at 100..169, keys at 60..149: some later keys
    got = it.index_scores(*on_device(q, k, w), 100, 60, 0.2).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.isinf(ref).any() and not torch.isinf(ref).all()
    finite = torch.isfinite(ref)
    # fp32 sums (32 products, 3 heads) in another order than torch's
    assert (got[finite] - ref[finite]).abs().max().item() <= 1e-5 * ref[finite].abs().max().item()


def test_index_scores_kernel_scales_keys_and_skips_future_tiles():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 70, 2, 16, generator=gen)
    k = torch.randn(1, 300, 16, generator=gen)  # key tiles 0..127, 128..255, 256..299: two wholly in the future
    w = torch.randn(1, 70, 2, generator=gen)
    ks = torch.rand(1, 300, generator=gen) + 0.5
    ref = _index_scores(q, k * ks[..., None], w, 0, 0, 0.3)
    got = it.index_scores(*on_device(q, k, w), 0, 0, 0.3, *on_device(ks)).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert (got[finite] - ref[finite]).abs().max().item() <= 1e-5 * ref[finite].abs().max().item()


def test_fp8_indexer_picks_the_keys_vllm_picks_ties_included():
    """On CUDA the fp8 values go through the kernel and one top-k per query chunk, which must keep
    the earliest of tied keys (torch 2.11's CUDA top-k does, measured up to 131,072-key rows); on
    the CPU the torch path's stable sort. Every third query's heads score most keys exactly 0."""
    gen = torch.Generator().manual_seed(4)
    seq, heads, topk = 2600, 2, 2048
    q, k = torch.randn(seq, heads, 128, generator=gen), torch.randn(seq, 128, generator=gen).abs()
    q[::3] = -q[::3].abs()
    w = torch.rand(seq, heads, generator=gen)
    k_fp8, k_scale = ops.quantize_index_keys(k)
    want = ops.rank_keys(q, w, k_fp8, k_scale, torch.arange(seq), topk, softmax_scale=128 ** -0.5)
    qd, kd, wd = on_device(q[None], k[None], w[None] * heads ** -0.5)
    got = indexer_topk(qd, kd, wd, topk, [0, 0, seq], 1024, 512, 128 ** -0.5, fp8=True)[0].cpu()
    for m in range(0, seq, 7):
        chosen = sorted(i for i in want[m].tolist() if i >= 0)
        assert sorted(i for i in got[m].tolist() if i <= m) == chosen, f"query {m}"


def test_sparse_attention_at_global_positions_matches_torch():
    gen = torch.Generator().manual_seed(1)
    n_heads, v_dim, rope, topk = 4, 64, 16, 16
    c = v_dim + rope
    pos = segment_positions(SEGMENTS, "cpu")
    q = torch.randn(1, len(pos), n_heads, c, generator=gen)
    kv = torch.randn(1, SEQ, c, generator=gen)
    scores = torch.rand(1, len(pos), SEQ, generator=gen)
    scores = torch.where(torch.arange(SEQ)[None, None, :] > pos[None, :, None], scores - 2.0, scores)
    idx = scores.topk(topk, dim=-1).indices
    dout = torch.randn(1, len(pos), n_heads, v_dim, generator=gen)
    q_ref, kv_ref = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    ref = _SparseLatentAttention.apply(q_ref, kv_ref, idx, 0.15, v_dim, 7, SEGMENTS)
    ref.backward(dout)
    q_t, kv_t, idx_t, pos_t, dout_t = on_device(q, kv, idx, pos, dout)
    q_t.requires_grad_(True)
    kv_t.requires_grad_(True)
    out = smt.sparse_latent_attention(q_t, kv_t, idx_t, 0.15, v_dim, pos_t)
    out.backward(dout_t)
    assert _rel(out, ref.detach()) < 1e-5
    assert _rel(q_t.grad, q_ref.grad) < 1e-5 and _rel(kv_t.grad, kv_ref.grad) < 1e-5
    assert kv_ref.grad[0, 60:].abs().sum() > 0  # keys of the other rank's chunk got gradients too
