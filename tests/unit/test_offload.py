"""titan_ext.offload: AdamW's moments leave the device at each forward and are back for the step, the
state_dict and a load; each block's input leaves after its forward and is back for its backward, with and
without activation checkpointing. Training is bit-for-bit the training without either."""

import copy

import pytest
import torch

from titan_ext.offload import LayerInputOffload, OptimizerStateOffload


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_moments_leave_at_forward_come_back_for_the_step_and_training_is_unchanged():
    model, opt = _model_and_optimizer(0)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    offload = OptimizerStateOffload(opt, [model])
    x = torch.randn(5, 8)
    for _ in range(4):
        _step(model, opt, x)
        _step(twin, twin_opt, x)
        moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert len(moments) == 8 and all(m.untyped_storage().size() > 0 for m in moments), "resident after the step"
        with torch.no_grad():
            model(x)
        assert all(m.untyped_storage().size() == 0 for m in moments), "released at the next forward"
        assert offload.offloaded_bytes == sum(m.numel() * 4 for m in moments)
        sd = opt.state_dict()  # a checkpoint save between forward and step sees the real state
        assert all(m.untyped_storage().size() > 0 for m in moments)
        assert all(torch.equal(sd["state"][i]["exp_avg"], twin_opt.state_dict()["state"][i]["exp_avg"]) for i in sd["state"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_loaded_state_is_offloaded_and_restored_like_the_first():
    model, opt = _model_and_optimizer(1)
    x = torch.randn(3, 8)
    _step(model, opt, x)
    saved = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(model)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    OptimizerStateOffload(resumed_opt, [resumed])
    resumed_opt.load_state_dict(saved)
    _step(model, opt, x)
    _step(resumed, resumed_opt, x)  # forward offloads the loaded tensors, the step brings them back
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Checkpointed(torch.nn.Module):
    """A block under activation checkpointing, as TorchTitan's AC wraps one (non-reentrant)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_layer_inputs_leave_after_forward_and_training_is_unchanged(checkpointed):
    torch.manual_seed(0)
    blocks = [_Block() for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), *[_Checkpointed(b) if checkpointed else b for b in blocks])
    twin = copy.deepcopy(model)
    offload = LayerInputOffload(list(model)[1:])
    x = torch.randn(6, 4)
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a[0])) for m in list(model)[1:]]
    out = model(x)
    for h in hooks:
        h.remove()
    assert offload.offloaded == 3 and all(t.untyped_storage().nbytes() == 0 for t in inputs), "moved out after forward"
    out.square().sum().backward()
    twin(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    with torch.no_grad():
        model(x)
    assert offload.offloaded == 3, "no gradient, nothing kept, nothing moved"
