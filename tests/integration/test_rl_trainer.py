"""The TorchTitan-hosted RL trainer, as `moerl rl` runs it: torchrun subprocess fed through the run directory."""

import json

import torch
from safetensors.torch import load_file

from rl_loop.batch import ModelShape, Sample, pack
from rl_loop.loss import token_logprobs
from rl_loop.trainer import TrainerSpec, batch_path, metrics_path, weights_dir, write_atomic
from tests.conftest import run_torchrun
from titan_ext.checkpoint import load_hf_checkpoint
from titan_ext.replay import moe_routers
from vllm_ext.weights.wire import COMMIT_MARKER, read_fs


def _write_batch(run, step, model, arch, seed):
    """Samples scored by the initial policy itself (on-policy), with its own routing as the record."""
    shape = ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(4):
        p, c = torch.randint(3, 512, (6,), generator=g).tolist(), torch.randint(3, 512, (5,), generator=g).tolist()
        toks = torch.tensor([p + c])
        captured = []
        hooks = [r.register_forward_hook(lambda m, a, o: captured.append(o[1])) for r in moe_routers(model)]
        with torch.no_grad():
            logits = model(toks[:, :-1])
        for h in hooks:
            h.remove()
        logp = token_logprobs(logits, toks[:, 1:])[0, len(p) - 1:].tolist()
        samples.append(Sample(p, c, logp, reward=float(i % 2), group=0, routing=torch.stack(captured, 2)[0].numpy(),
                              advantage=float(i % 2) - 0.5))
    batch, rejected = pack(samples, shape, pad_id=2)
    assert not rejected
    write_atomic(batch_path(run, step), lambda t: torch.save(batch.to_dict(), t))


def test_trainer_steps_publishes_versions_and_resumes(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    run = tmp_path / "run"
    spec = TrainerSpec(model="kimi_k2", flavor="tiny", init_checkpoint=str(ckpt), steps=1, lr=1e-3, replay=True,
                       max_ratio=2.0, checkpoint_interval=1)
    spec.save(run)
    _write_batch(run, 1, model, arch, seed=0)
    proc = run_torchrun(2, "-m", "rl_loop.trainer", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1 = json.loads(metrics_path(run, 1).read_text())
    # On-policy batch replaying the policy's own routing: no mismatch, no disagreement.
    assert m1["mismatch_k3_max"] < 1e-6 and m1["router_disagreement"] == 0.0 and m1["tokens"] == 20
    assert all((weights_dir(run, v) / COMMIT_MARKER).exists() for v in (0, 1))
    v0, v1 = (dict(read_fs(weights_dir(run, v))[1]) for v in (0, 1))
    original = load_file(ckpt / "model.safetensors")
    assert v0.keys() == original.keys()
    assert all(torch.equal(v0[k], original[k].to(torch.bfloat16)) for k in original), "v0 is the initial policy"
    assert any(not torch.equal(v0[k], v1[k]) for k in v0)

    # A second invocation with more steps resumes from the step-1 checkpoint instead of starting over.
    spec.steps = 2
    spec.save(run)
    _write_batch(run, 2, model, arch, seed=1)
    v1_mtime = (weights_dir(run, 1) / COMMIT_MARKER).stat().st_mtime_ns
    proc = run_torchrun(1, "-m", "rl_loop.trainer", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m2 = json.loads(metrics_path(run, 2).read_text())
    assert m2["step"] == 2 and m2["router_disagreement"] > 0, "step 2 replays records of the initial policy"
    assert (weights_dir(run, 2) / COMMIT_MARKER).exists()
    assert (weights_dir(run, 1) / COMMIT_MARKER).stat().st_mtime_ns == v1_mtime
