"""Optimizer-state offload: AdamW's moments leave the device at each forward and are back for the step,
the state_dict and a load; training is bit-for-bit the training without it."""

import copy

import torch

from titan_ext.offload import OptimizerStateOffload


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
