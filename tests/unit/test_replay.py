"""Router replay is exact: same ids -> bit-identical loss and gradients; forced ids are used and trained."""

import pytest
import torch

from titan_ext.models import model_spec
from titan_ext.replay import ReplayRecordError, disagreement_by_layer, moe_routers, replay_routing


@pytest.fixture(autouse=True)
def deterministic():
    """TorchTitan's MoE backward (scatter_add) is not bit-reproducible run to run otherwise."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _model(seed=0):
    torch.manual_seed(seed)
    m = model_spec("kimi_k2", "tiny").model.build()
    m.init_states()
    with torch.no_grad():  # make routing matter: default init is near uniform
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return m


def _own_ids(model, tokens):
    captured = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: captured.append(out[1].clone())) for r in moe_routers(model)]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return torch.stack(captured, dim=2)


def _loss_and_grads(model, tokens, ids):
    model.zero_grad(set_to_none=True)
    with replay_routing(model, ids):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def test_replaying_the_routers_own_choice_is_bit_identical():
    model = _model()
    ids = _own_ids(model, TOKENS)
    loss0, grads0 = _loss_and_grads(model, TOKENS, None)
    loss1, grads1 = _loss_and_grads(model, TOKENS, ids)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    assert disagreement_by_layer(moe_routers(model)) == [0.0] * len(moe_routers(model))


def test_forced_ids_are_used_and_gradients_reach_their_gate_rows():
    model = _model()
    routers = moe_routers(model)
    n_layers, k = len(routers), routers[0].top_k
    # Every token of every layer goes to experts 0..k-1, which the router rarely picks together.
    forced = torch.arange(k).expand(*TOKENS.shape, n_layers, k).contiguous()
    own = _own_ids(model, TOKENS)
    loss_free, _ = _loss_and_grads(model, TOKENS, None)
    for m in model.modules():
        if hasattr(m, "tokens_per_expert_E"):
            m.tokens_per_expert_E.zero_()
    model.train()
    loss_forced, grads = _loss_and_grads(model, TOKENS, forced)
    assert not torch.equal(loss_free, loss_forced)
    for i, layer in enumerate(l for l in model.layers.values() if l.moe_enabled):
        counts = layer.moe.tokens_per_expert_E
        assert torch.all(counts[:k] == TOKENS.numel()) and torch.all(counts[k:] == 0)
        gate_grad = grads[f"layers.{list(model.layers.keys())[i + 1]}.moe.router.gate.weight"]
        row_norms = gate_grad.norm(dim=1)
        assert torch.all(row_norms[:k] > 0), "replayed experts' gate rows get gradient"
        assert torch.all(row_norms[k:] == 0), "sigmoid gates of unselected experts get none"
    frac = disagreement_by_layer(routers)
    expected = [(own[:, :, i].sort(-1).values != forced[:, :, i]).any(-1).float().mean().item() for i in range(n_layers)]
    assert frac == pytest.approx(expected) and all(f > 0.9 for f in frac)


def test_padding_counts_in_neither_the_expert_load_nor_the_disagreement():
    """Context parallel pads sequences to equal chunks: the experts chosen at padding must not move the
    load-balancing bias (the MoE's `tokens_per_expert_E`) nor the disagreement metric."""
    model = _model().train()
    routers = moe_routers(model)
    moes = [layer.moe for layer in model.layers.values() if layer.moe_enabled]
    k = routers[0].top_k
    padding = torch.zeros(TOKENS.shape, dtype=torch.bool)
    padding[:, -5:] = True
    real = int((~padding).sum())
    own = _own_ids(model, TOKENS)
    forced = own.clone()
    forced[:, -5:] = torch.arange(k)  # disagrees at padding only
    for ids in (forced, None):
        for moe in moes:
            moe.tokens_per_expert_E.zero_()
        with replay_routing(model, ids, padding):
            model(TOKENS)
        assert all(int(moe.tokens_per_expert_E.sum()) == real * k for moe in moes)
    for moe in moes:
        moe.tokens_per_expert_E.zero_()
    with replay_routing(model, forced, padding):
        model(TOKENS)
    assert disagreement_by_layer(routers) == [0.0] * len(routers)
    assert all(torch.equal(moe.tokens_per_expert_E, torch.bincount(own[:, :-5, i].flatten(), minlength=len(
        moe.tokens_per_expert_E)).to(moe.tokens_per_expert_E.dtype)) for i, moe in enumerate(moes))


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda ids: ids[:, :-1], "shape"),
        (lambda ids: ids[:, :, :-1], "shape"),
        (lambda ids: ids[..., :-1], "shape"),
        (lambda ids: ids + 64, "lie in"),
        (lambda ids: ids.float(), "integers"),
    ],
)
def test_records_that_do_not_fit_are_refused_before_running(bad, match):
    model = _model()
    ids = _own_ids(model, TOKENS)
    with pytest.raises(ReplayRecordError, match=match):
        with replay_routing(model, bad(ids)):
            model(TOKENS)
    assert all(r.replay_ids_BLK is None for r in moe_routers(model))
