import math

import pytest
import torch

from rl_loop.advantages import group_advantages
from rl_loop.loss import LossConfig, mismatch_k3, policy_loss, token_logprobs


def test_group_advantages_center_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r)
    assert torch.allclose(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(group_advantages(r, normalize_std=True)[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(4))


def test_k3_is_zero_on_agreement_and_matches_formula():
    lp = torch.log(torch.tensor([0.5, 0.25]))
    assert torch.all(mismatch_k3(lp, lp) == 0)
    d = math.log(0.5) - math.log(0.25)
    assert mismatch_k3(lp[:1], lp[1:]).item() == pytest.approx(math.exp(d) - d - 1)


def test_on_policy_gradient_is_the_reinforce_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    logp = token_logprobs(logits, targets)
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    out = policy_loss(logp, logp.detach(), adv, mask)
    out.loss.backward()
    logits2 = logits.detach().clone().requires_grad_()
    ref = -(token_logprobs(logits2, targets) * adv * mask).sum() / 4
    ref.backward()
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-6)
    assert out.k3_mean == 0 and out.extreme_frac == 0 and out.num_tokens == 4


def test_extreme_tokens_are_masked_not_clipped():
    logp_train = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_()
    logp_infer = torch.log(torch.tensor([[0.5, 0.1, 0.5]]))  # middle token: ratio 5
    out = policy_loss(logp_train, logp_infer, torch.ones(1, 3), torch.ones(1, 3), LossConfig(max_ratio=2.0))
    out.loss.backward()
    assert logp_train.grad[0, 1] == 0 and logp_train.grad[0, 0] != 0
    assert out.extreme_frac == pytest.approx(1 / 3) and out.masked_frac == pytest.approx(1 / 3)
    assert out.k3_max == pytest.approx(5 - math.log(5) - 1, rel=1e-5)


def test_parts_of_a_batch_sum_to_its_loss_and_gradient():
    """A rank's part (data- or context-parallel) divides by the whole batch's token count; a part may hold none."""
    logp_train = torch.randn(2, 6, requires_grad=True)
    logp_infer, adv = logp_train.detach() + 0.3 * torch.randn(2, 6), torch.tensor([[1.0], [-2.0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    whole = policy_loss(logp_train, logp_infer, adv, mask)
    (g_whole,) = torch.autograd.grad(whole.loss, logp_train)
    parts = [policy_loss(logp_train[:, s], logp_infer[:, s], adv, mask[:, s], total_tokens=5)
             for s in (slice(0, 2), slice(2, 6))]
    assert parts[0].num_tokens == 0 and parts[0].k3_max == 0 and parts[0].loss.item() == 0
    (g_parts,) = torch.autograd.grad(parts[0].loss + parts[1].loss, logp_train)
    assert torch.allclose(parts[0].loss + parts[1].loss, whole.loss) and torch.allclose(g_parts, g_whole)


def test_bad_shapes_and_empty_batches_are_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 3))
    with pytest.raises(ValueError, match="no completion tokens"):
        policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3))
