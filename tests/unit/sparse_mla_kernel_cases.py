"""Cases: the Triton sparse latent attention (DSA) against the torch path it replaces on CUDA.

Not collected on its own: `test_triton_interpreter.py` runs this file under Triton's interpreter
on CPU (in a fresh process: the interpreter must be on before Triton is first imported), and
`benchmarks.gpu_check` on a CUDA GPU (`kernel_device.py` picks the device). fp32 throughout,
on CPU-made inputs, against the torch path on the CPU: the interpreter's bf16 matmuls are wrong
on CPU, and fp32 lets the comparison be tight, so any indexing, masking, softmax or
gradient-formula slip shows. On the GPU the same bounds hold: the dots are IEEE fp32 there
(TRITON_F32_DEFAULT=ieee); exp2/log2 are the hardware's approximations (a few fp32 ulps), and
the key gradient's fp32 atomics add in any order, each far under the 1e-5 relative bounds.
bf16 numerics on the GPU are checked by benchmarks on the H200.
"""

import pytest
import torch

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

import titan_ext.models.glm5.sparse_mla_triton as smt  # noqa: E402
from tests.unit.kernel_device import DEVICE, on_device  # noqa: E402
from titan_ext.models.glm5.dsa import _SparseLatentAttention, sparse_attention_impl  # noqa: E402


def _indexer_like(bsz, seqlen, topk, gen):
    """Each query's top-k of random scores with later keys below every earlier one, as the
    indexer selects: no duplicates in a row; queries with fewer than top-k earlier keys also
    select later ones, here random ones (the indexer's -inf ties would let topk pick the
    same far-future keys every time, and the key right after the query must be exercised)."""
    scores = torch.rand(bsz, seqlen, seqlen, generator=gen)
    future = torch.arange(seqlen)[None, :] > torch.arange(seqlen)[:, None]
    scores = torch.where(future, scores - 2.0, scores)
    return scores.topk(topk, dim=-1).indices


def _rel(a, b):
    a = a.detach().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "bsz,seqlen,n_heads,topk,v_dim,rope,block_n,chunk",
    [
        (1, 96, 4, 32, 64, 16, 32, None),  # padded heads (4 -> 16), first 31 queries select later keys
        # two batch rows (offsets into kv), two key blocks per query; backward chunks of 97
        # query tokens, one of them across the batch boundary, the last one short
        (2, 130, 16, 32, 64, 16, 16, 97),
        (1, 200, 5, 40, 64, 16, 32, 64),  # topk not a multiple of the key block: masked tail
    ],
)
def test_triton_matches_torch_sparse_attention(bsz, seqlen, n_heads, topk, v_dim, rope, block_n, chunk):
    gen = torch.Generator().manual_seed(seqlen + n_heads)
    c = v_dim + rope
    q = torch.randn(bsz, seqlen, n_heads, c, generator=gen)
    kv = torch.randn(bsz, seqlen, c, generator=gen)
    idx = _indexer_like(bsz, seqlen, topk, gen)
    assert (idx == torch.arange(seqlen)[:, None] + 1).any()  # the first future key is selected somewhere
    scale = c**-0.5 * 2.0  # sharper than uniform attention
    dout = torch.randn(bsz, seqlen, n_heads, v_dim, generator=gen)

    q_ref, kv_ref = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    ref = _SparseLatentAttention.apply(q_ref, kv_ref, idx, scale, v_dim, 17)
    ref.backward(dout)
    lse_ref = torch.cat(
        [_SparseLatentAttention._probs(q[b], kv[b], idx[b], 0, scale)[2].unsqueeze(0) for b in range(bsz)]
    )

    qd, kvd, idxd, doutd = on_device(q, kv, idx, dout)
    cfg = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    out, lse = smt.sparse_mla_fwd(qd, kvd, idxd, scale, v_dim, cfg)
    assert out.shape == ref.shape and lse.shape == (bsz, seqlen, n_heads)
    assert out.device == DEVICE and out.dtype == torch.float32
    assert _rel(out, ref.detach()) < 1e-5
    assert (lse.cpu() - lse_ref).abs().max().item() < 1e-4

    dkv_cfg = {"BLOCK_N": 16 if block_n == 32 else 32, "SPLIT_V": 2 if chunk else 1, "num_warps": 4, "num_stages": 1}
    dq, dkv = smt.sparse_mla_bwd(qd, kvd, idxd, out, lse, doutd, scale, cfg, dkv_cfg, chunk)
    assert _rel(dq, q_ref.grad) < 1e-5
    assert _rel(dkv, kv_ref.grad) < 1e-5
    # Keys nobody may attend to (selected only as future keys, or never) get exactly zero.
    untouched = kv_ref.grad.abs().sum(-1) == 0
    assert torch.equal(dkv.cpu().abs().sum(-1) == 0, untouched)


def test_autograd_function_and_dispatch():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 64, 4, 80, generator=gen, requires_grad=True)
    kv = torch.randn(1, 64, 80, generator=gen, requires_grad=True)
    idx = _indexer_like(1, 64, 32, gen)
    qd, kvd, idxd = on_device(q.detach(), kv.detach(), idx)
    qd.requires_grad_(True)
    kvd.requires_grad_(True)
    out = smt.sparse_latent_attention(qd, kvd, idxd, 0.1, 64)
    (out * out).sum().backward()
    ref = _SparseLatentAttention.apply(q, kv, idx, 0.1, 64, 64)
    (ref * ref).sum().backward()
    assert _rel(out, ref.detach()) < 1e-5
    assert _rel(qd.grad, q.grad) < 1e-5 and _rel(kvd.grad, kv.grad) < 1e-5
    # CPU tensors always take the torch path, CUDA ones these kernels; the kernels need power-of-two widths.
    assert sparse_attention_impl(q, kv, 64) == "torch"
    assert sparse_attention_impl(qd, kvd, 64) == ("triton" if DEVICE.type == "cuda" else "torch")
    assert smt.supported(q, kv, 64) and not smt.supported(torch.empty(1, 1, 1, 90), torch.empty(1, 1, 90), 64)
