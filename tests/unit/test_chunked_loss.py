"""The RL loss chunk by chunk over the LM head equals the whole-sequence loss: value, metrics, entropy,
and the gradients of the hidden states and of the LM head, for chunk sizes that are not powers of two."""

import pytest
import torch

from rl_loop.chunked_loss import chunk_count, chunked_policy_loss
from rl_loop.loss import LossConfig, policy_loss, token_logprobs, token_logprobs_and_entropy
from tests.conftest import ulp_tol

B, S, D, V = 2, 21, 16, 37


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    targets = torch.randint(0, V, (B, S), generator=g)
    with torch.no_grad():
        logp = token_logprobs(head(hidden), targets)
    logp_infer = logp + 0.5 * torch.randn(B, S, generator=g)  # another engine's scores: some ratios extreme
    mask = torch.rand(B, S, generator=g) < 0.7
    advantages = torch.tensor([[0.5], [-1.0]])
    return hidden, head, targets, logp_infer, advantages, mask


def _whole(hidden, head, targets, logp_infer, advantages, mask):
    h = hidden.clone().requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(head(h), targets)
    out = policy_loss(logp, logp_infer, advantages, mask, LossConfig(), total_tokens=40)
    out.entropy_mean = (entropy * mask).sum().item() / out.num_tokens
    out.loss.backward()
    return out, h.grad, head.weight.grad


@pytest.mark.parametrize("num_chunks", [3, 7, 21])  # chunks of 7, 3 and 1 positions
def test_chunked_loss_equals_the_whole_sequence_loss(num_chunks):
    hidden, head, targets, logp_infer, advantages, mask = _inputs(0)
    whole, h_grad, w_grad = _whole(hidden, head, targets, logp_infer, advantages, mask)
    head.weight.grad = None
    h = (hidden.clone().requires_grad_(True))
    out = chunked_policy_loss(h * 1.0, head, targets, logp_infer, advantages, mask, LossConfig(), 40, num_chunks)
    out.loss.backward()
    assert 0 < whole.masked_frac < 1 and whole.extreme_frac > 0, "the masking rule is exercised"
    assert (out.num_tokens, out.extreme_frac, out.masked_frac) == (whole.num_tokens, whole.extreme_frac,
                                                                   whole.masked_frac)
    assert abs(out.loss.item() - whole.loss.item()) <= ulp_tol(torch.float32, whole.loss, 8)
    for key in ("k3_mean", "k3_max", "entropy_mean"):
        assert getattr(out, key) == pytest.approx(getattr(whole, key), rel=1e-6), key
    assert (h.grad - h_grad).abs().max() <= ulp_tol(torch.float32, h_grad, 8)
    assert (head.weight.grad - w_grad).abs().max() <= ulp_tol(torch.float32, w_grad, 8)


def test_chunks_must_divide_the_sequence_and_count_tokens():
    hidden, head, targets, logp_infer, advantages, mask = _inputs(1)
    with pytest.raises(ValueError, match="4 loss chunks do not divide the local sequence of 21 positions"):
        chunked_policy_loss(hidden, head, targets, logp_infer, advantages, mask, LossConfig(), None, 4)
    with pytest.raises(ValueError, match="no completion tokens"):
        chunked_policy_loss(hidden, head, targets, logp_infer, advantages, mask & False, LossConfig(), None, 3)
    assert [chunk_count(n, 1024) for n in (1, 1024, 1025, 32768)] == [1, 1, 2, 32]
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunk_count(10, 0)


def test_logprobs_and_entropy_share_one_softmax_and_match_their_definitions():
    hidden, head, targets, *_ = _inputs(2)
    logits = head(hidden)
    logp, entropy = token_logprobs_and_entropy(logits, targets)
    assert torch.equal(logp, token_logprobs(logits, targets)) and logp.requires_grad and not entropy.requires_grad
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), rtol=1e-5)
