"""GLM-5's DSA attention under TorchTitan's activation checkpointing policies.

Selective AC caches the outputs of the matmuls it sees and refuses them mutated in the
recompute; the DSA indexer and the torch sparse attention keep their in-place scratch
inside opaque ops. Checkpointing must change nothing: on CPU in fp32 the recompute runs
the same ops in the same order, so outputs and gradients are compared exactly.
"""

import copy

import pytest
import torch
from torch import nn
from torchtitan.config import derive
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

import titan_ext
from titan_ext.models import get_arch
from titan_ext.models.builder import build_model_config
from titan_ext.models.glm5.dsa import DSAAttention

titan_ext.activate()  # the trainer's patches (patches/)


def _dsa(impl: str) -> tuple[DSAAttention, int]:
    cfg = build_model_config(get_arch("glm5", "tiny"))
    attn_cfg = derive(cfg.layers[0].attention, DSAAttention.Config, impl=impl, query_chunk=5)
    attn_cfg.indexer.query_chunk = 7  # several indexer chunks, each with sparse selections
    torch.manual_seed(0)
    attn = attn_cfg.build()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return attn, cfg.dim


def _checkpointed(module: nn.Module, policy) -> nn.Module:
    """`module` wrapped as TorchTitan wraps a transformer block (`policy.apply` on `layers`)."""
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": module})
    policy.apply(holder)
    return holder.layers["0"]


def _run(module, x):
    x = x.clone().requires_grad_(True)
    y = module(x, None, None)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), {"x": x.grad, **{n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                          for n, p in module.named_parameters()}}


@pytest.mark.parametrize("impl", ["sparse", "dense_mask"])
@pytest.mark.parametrize("policy", [SelectiveAC(SelectiveAC.Config()), FullAC(FullAC.Config())],
                         ids=["selective", "full"])
def test_dsa_under_activation_checkpointing_matches_no_checkpointing(impl, policy):
    attn, dim = _dsa(impl)
    x = torch.randn(2, 40, dim)  # 40 tokens > indexer top-k 8: sparse selections
    ref_out, ref_grads = _run(attn, x)
    out, grads = _run(_checkpointed(copy.deepcopy(attn), policy), x)
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g is None or torch.equal(grads[name], g), name
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in ref_grads.values()) >= 8
