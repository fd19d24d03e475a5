"""titan_ext's fp8 expert FFN (`fp8_experts.py`) on CPU: the math of every GEMM's layout and scale.

On CPU `torch._scaled_mm` runs the same per-expert calls as on the GPU and the quantisation
runs as torch; the Triton kernels are checked against that torch formulation under Triton's
interpreter (`fp8_quant_kernel_cases.py`, in a fresh process). A wrong transpose, scale
or group offset puts the output or a gradient ~100% off (8 e4m3 resolutions, eps = 2^-3); fp8
rounding alone leaves a relative error of about half of one (0.44-0.68 eps measured), and more
than an eighth of one (2^-6): above bf16 rounding alone (at most 2^-8 of each element), so the
fp8 path really ran.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.models import get_arch  # noqa: E402
from titan_ext.models.builder import build_model_config  # noqa: E402
from titan_ext.models.experts import lean_permutation  # noqa: E402
from titan_ext.models.fp8_experts import (  # noqa: E402
    Fp8FeedForward, Fp8RoutedExperts, Route, cached_weights, drop_cached_weights, fp8_swiglu, to_fp8)

FP8_EPS = torch.finfo(torch.float8_e4m3fn).eps


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _ffn_ref(x, w1, w3, w2, counts):
    out, s = [], 0
    for e, n in enumerate(counts):
        xe = x[s:s + n]
        out.append((F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t())
        s += n
    return torch.cat(out)


def test_fp8_ffn_matches_fp32_to_fp8_precision():
    g = torch.Generator().manual_seed(0)
    e, f, d = 4, 32, 48
    counts = [48, 0, 64, 16]  # an empty expert; groups are multiples of 16 (the column-maximum blocks)
    x = torch.randn(sum(counts), d, generator=g)
    w1, w3 = (torch.randn(e, f, d, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(e, d, f, generator=g) * 0.2
    gy = torch.randn(sum(counts), d, generator=g)
    ins = [t.to(torch.bfloat16).requires_grad_(True) for t in (x, w1, w3, w2)]
    y = fp8_swiglu(*ins, counts, cached_weights(torch.nn.Module(), *ins[1:]))
    y.backward(gy.to(torch.bfloat16))
    refs = [t.clone().requires_grad_(True) for t in (x, w1, w3, w2)]
    y_ref = _ffn_ref(*refs, counts)
    y_ref.backward(gy)
    assert y.dtype == torch.bfloat16
    for got, want in zip([y] + [t.grad for t in ins], [y_ref] + [t.grad for t in refs]):
        assert got.shape == want.shape
        assert FP8_EPS / 8 < _rel(got, want) < FP8_EPS  # fp8 rounding, nothing worse
    assert torch.count_nonzero(ins[1].grad[1]) == 0  # the empty expert gets zero gradient


def test_routed_fp8_ffn_dispatches_and_combines():
    """The routed form (rows gathered from tokens, output combined with scores) against fp32
    dispatch -> per-expert FFN -> weighted combine, gradients of x, scores and weights included."""
    g = torch.Generator().manual_seed(4)
    t, k, e, f, d = 40, 3, 4, 32, 48
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:, 0] = torch.where(ids[:, 0] == 1, 0, ids[:, 0])  # expert 1 rarely chosen: uneven groups
    scores = torch.rand(t, k, generator=g)
    x = torch.randn(t, d, generator=g)
    w1, w3 = (torch.randn(e, f, d, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(e, d, f, generator=g) * 0.2
    gy = torch.randn(t, d, generator=g)
    src, slot, score_r, counts = lean_permutation(ids, scores, torch.bincount(ids.reshape(-1), minlength=e), 16)
    ins = [v.to(torch.bfloat16).requires_grad_(True) for v in (x, scores, w1, w3, w2)]
    xb, sb, *ws = ins
    r = int(counts.sum())
    out = fp8_swiglu(xb, *ws, counts.tolist(), cached_weights(torch.nn.Module(), *ws),
                     Route(src[:r], slot, score_r[:r].to(torch.bfloat16)), sb)
    out.backward(gy.to(torch.bfloat16))
    refs = [v.clone().requires_grad_(True) for v in (x, scores, w1, w3, w2)]
    xr, sr, w1r, w3r, w2r = refs
    y_tk = torch.stack([torch.stack([(F.silu(xr[i] @ w1r[j].t()) * (xr[i] @ w3r[j].t())) @ w2r[j].t()
                                     for j in ids[i].tolist()]) for i in range(t)])
    ref = (y_tk * sr[:, :, None]).sum(1)
    ref.backward(gy)
    assert out.shape == (t, d) and out.dtype == torch.bfloat16
    for got, want in zip([out] + [v.grad for v in ins], [ref] + [v.grad for v in refs]):
        assert got.shape == want.shape
        assert FP8_EPS / 8 < _rel(got, want) < FP8_EPS


def test_weights_requantised_only_when_a_parameter_changes():
    owner = torch.nn.Module()
    w1, w3 = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    w2 = torch.randn(2, 32, 16)
    first = cached_weights(owner, w1, w3, w2)
    assert cached_weights(owner, w1, w3, w2) is first
    w2.mul_(2)  # an optimizer step updates in place
    second = cached_weights(owner, w1, w3, w2)
    assert second is not first
    torch.testing.assert_close(second.w2[1], first.w2[1] * 2)  # scales doubled, fp8 values the same
    assert torch.equal(second.w2[0].float(), first.w2[0].float())
    torch.testing.assert_close(second.w2_t[1], first.w2_t[1] * 2)  # the transposed layout too
    drop_cached_weights(owner)
    assert cached_weights(owner, w1, w3, w2) is not second


def _moe(model):
    cfg = build_model_config(get_arch(model, "tiny"))
    torch.manual_seed(3)
    moe = next(layer for layer in cfg.layers if layer.moe is not None).moe.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    return moe.to(torch.bfloat16)


@pytest.mark.parametrize("model", ["kimi_k2", "glm5"])
def test_to_fp8_moe_block_close_to_bf16(model):
    bf16 = _moe(model)
    fp8 = to_fp8(copy.deepcopy(bf16))
    assert type(fp8.routed_experts) is Fp8RoutedExperts
    assert type(fp8.shared_experts) is Fp8FeedForward
    # 46 tokens: the shared expert pads them to 48
    x = torch.randn(2, 23, bf16.router.gate.in_features, generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for m in (bf16, fp8):
        xi = x.to(torch.bfloat16).requires_grad_(True)
        loss = m(xi).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({"x": xi.grad, **{n: p.grad for n, p in m.named_parameters() if p.grad is not None}})
    assert abs(losses[1] - losses[0]) < FP8_EPS / 4 * abs(losses[0])  # 0.03 eps measured
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 8  # x, gate, 3 routed, 3 shared
    for name, g in grads[0].items():
        assert _rel(grads[1][name], g) < FP8_EPS, name


def test_selective_checkpointing_sees_no_weight_quantisation():
    """The weight cache may hit in the forward and miss in the recompute (here: dropped in between;
    in `torchtitan train --titan_ext.fp8` with EP 2, storage moved under FSDP). Selective activation
    checkpointing counts every op it sees, so a quantisation it saw only in the recompute failed the
    backward: `aten.amax.default invocation index 10 encountered during backward but not found in
    storage` (CI run 19). The gradients must be those of the block without checkpointing."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    fp8 = to_fp8(_moe("kimi_k2"))
    x = torch.randn(2, 16, fp8.router.gate.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fp8(x)  # fills the weight cache: the checkpointed forward hits it
    grads = []
    for checkpointed in (False, True):
        fp8.zero_grad()
        if checkpointed:
            y = checkpoint(fp8, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(
                lambda ctx, func, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE))
            drop_cached_weights(fp8)  # the recompute misses
        else:
            y = fp8(x)
        y.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in fp8.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 7
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name
