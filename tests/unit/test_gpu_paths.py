"""The GPU-speed paths of titan_ext (lean token permutation, sparse DSA) against their references, on CPU.

Both must compute exactly the reference function: fp32, small shapes, fresh random inputs,
outputs and every gradient compared.
"""

import copy

import pytest
import torch
from torchtitan.config import derive

import titan_ext
from titan_ext.models import get_arch
from titan_ext.models.builder import build_model_config
from titan_ext.models.experts import LeanTokenDispatcher
from titan_ext.models.glm5.dsa import DSAAttention

titan_ext.activate()  # the trainer's patches (patches/)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _moe_layer(model, seed):
    cfg = build_model_config(get_arch(model, "tiny"))
    layer_cfg = next(layer for layer in cfg.layers if layer.moe is not None)
    torch.manual_seed(seed)
    moe = layer_cfg.moe.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.expert_bias_E.normal_(0, 0.1)
    return layer_cfg.moe, moe


def lean_matches_stock(model: str, pad: int, device: torch.device) -> None:
    """The lean dispatcher's block on `device` computes TorchTitan's dispatch (on the CPU): the output
    and every gradient. Also run on the GPU's kernels by `lean_dispatch_kernel_cases.py`."""
    moe_cfg, stock = _moe_layer(model, seed=1)
    lean_cfg = copy.deepcopy(moe_cfg)
    d = lean_cfg.routed_experts.token_dispatcher
    lean_cfg.routed_experts.token_dispatcher = derive(d, LeanTokenDispatcher.Config, pad_multiple=pad)
    lean = lean_cfg.build()
    lean.load_state_dict(stock.state_dict())
    lean.to(device)
    x = torch.randn(2, 37, stock.router.gate.in_features)
    outs, grads = [], []
    for m in (stock, lean):
        on = next(m.parameters()).device
        xi = x.to(on, copy=True).requires_grad_(True)
        y = m(xi)
        (y * torch.linspace(-1, 1, y.numel()).to(on).view_as(y)).sum().backward()
        outs.append(y.detach().cpu())
        grads.append([g.cpu() for g in [xi.grad] + [p.grad for p in m.parameters()]])
    assert _rel(outs[1], outs[0]) < 1e-5
    assert len(grads[1]) == len(grads[0])
    for g_lean, g_stock in zip(grads[1], grads[0]):
        assert _rel(g_lean, g_stock) < 1e-5


@pytest.mark.parametrize("model,pad", [("kimi_k2", 1), ("glm5", 1), ("kimi_k2", 16)])
def test_lean_dispatch_matches_torchtitan_dispatch(model, pad):
    lean_matches_stock(model, pad, torch.device("cpu"))


def _dsa(impl, seed=0):
    cfg = build_model_config(get_arch("glm5", "tiny"))
    attn_cfg = cfg.layers[0].attention
    assert isinstance(attn_cfg, DSAAttention.Config)
    attn_cfg = derive(attn_cfg, DSAAttention.Config, impl=impl, query_chunk=5)
    attn_cfg.indexer.query_chunk = 7
    torch.manual_seed(seed)
    attn = attn_cfg.build()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return attn, cfg


def test_sparse_dsa_matches_dense_mask_reference():
    sparse, cfg = _dsa("sparse")
    dense = copy.deepcopy(sparse)
    dense.impl = "dense_mask"
    dense.indexer.query_chunk = 10**9  # one chunk: the full S x S score matrix
    seqlen = 40  # > indexer top-k (8) and > both chunk sizes: sparse selection, several chunks
    x = torch.randn(2, seqlen, cfg.dim)
    pos = None
    sel_chunked = sparse.indexer(x, sparse.q_norm(sparse.wq_a(x)), sparse.rope, pos)
    sel_full = dense.indexer(x, dense.q_norm(dense.wq_a(x)), dense.rope, pos)
    causal = sel_full <= torch.arange(seqlen)[None, :, None]
    assert torch.equal(sel_chunked.sort(-1).values[causal.all(-1)], sel_full.sort(-1).values[causal.all(-1)])
    outs, grads = [], []
    for m in (sparse, dense):
        xi = x.clone().requires_grad_(True)
        y = m(xi, None, pos)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y)
        grads.append({"x": xi.grad, **{n: p.grad for n, p in m.named_parameters() if p.grad is not None}})
    assert _rel(outs[0], outs[1]) < 1e-5
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        assert _rel(grads[0][name], grads[1][name]) < 1e-4, name
