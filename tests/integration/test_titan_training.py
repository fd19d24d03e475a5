"""TorchTitan with titan_ext on gloo, several processes: FSDP2, FSDP2 + expert parallel 2."""

import pytest
import torch

from tests.conftest import ROOT, VENV_BIN, losses_from_log, run_torchrun

TORCHTITAN = str(VENV_BIN / "torchtitan")


def _logits(tmp_path, ckpt, model, ep, *flags):
    out = tmp_path / f"logits_ep{ep}{''.join(flags)}.pt"
    proc = run_torchrun(ep, str(ROOT / "tests/integration/ep_logits_worker.py"), str(ckpt), model, str(ep), str(out), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("model", ["kimi_k2", "glm5"])
def test_expert_parallel_2_gives_the_same_logits_as_ep_1(tiny_checkpoint, tmp_path, model):
    ckpt = tiny_checkpoint(model, 0.1)
    ep1, ep2 = _logits(tmp_path, ckpt, model, 1), _logits(tmp_path, ckpt, model, 2)
    assert ep1.shape == ep2.shape and ep1.abs().max() > 0.1
    assert (ep1 - ep2).abs().max().item() <= 1e-5


def test_replayed_loss_under_fsdp2_and_ep2_equals_single_process(tiny_checkpoint, tmp_path):
    from tests.integration.ep_logits_worker import fixed_batch
    from titan_ext.checkpoint import load_hf_checkpoint
    from titan_ext.replay import moe_routers, replay_routing

    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    tokens, ids = fixed_batch(arch.vocab_size, len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    with torch.no_grad(), replay_routing(model, ids) as routers:
        single = model(tokens)
    assert min(r.disagreement for r in moe_routers(model) if r.disagreement is not None) > 0.9
    assert len(routers) == len(arch.moe_layer_ids)
    distributed = _logits(tmp_path, ckpt, "kimi_k2", 2, "--replay")

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    with torch.no_grad():
        own = model(tokens)
    assert (single - distributed).abs().max().item() <= 1e-5
    assert abs(loss(single).item() - loss(distributed).item()) <= 1e-6
    assert (own - single).abs().max().item() > 1e-2, "the random record really changed the routing"


def _train(tmp_path, nproc, *flags):
    proc = run_torchrun(
        nproc, TORCHTITAN, "train", "--extension", "titan_ext", "--model", "kimi_k2", "--flavor", "tiny",
        "--dump_folder", str(tmp_path), *flags,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses_from_log(proc.stdout + proc.stderr)


def test_twenty_steps_with_expert_parallel_2_reduce_loss(tmp_path):
    losses = _train(tmp_path, 2, "--training.steps", "20", "--parallelism.expert_parallel_degree", "2")
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_fsdp_two_processes_reduce_loss(tmp_path):
    losses = _train(tmp_path, 2, "--training.steps", "10")
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
