"""The TorchTitan-hosted RL trainer, as `moerl rl` runs it: torchrun subprocess fed through the run directory."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rl_loop.batch import ModelShape, Sample, pack
from rl_loop.config import RLConfig, parse_overrides
from rl_loop.loss import token_logprobs
from rl_loop.run_dir import batch_path, metrics_path, weights_dir, write_atomic
from rl_loop.trainer import TrainerSpec
from tests.conftest import ROOT, run_torchrun, ulp_tol
from titan_ext.checkpoint import load_hf_checkpoint
from titan_ext.replay import moe_routers
from vllm_ext.transport.wire import COMMIT_MARKER, read_fs


def _write_batch(run, step, model, arch, seed, logp_noise=0.0):
    """Samples scored by the initial policy itself (on-policy), with its own routing as the record;
    `logp_noise`: the std of noise added to the logprobs, as if another engine had scored them."""
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
        logp = token_logprobs(logits, toks[:, 1:])[0, len(p) - 1:]
        logp = (logp + logp_noise * torch.randn(logp.shape, generator=g)).tolist()
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
    assert m1["lr"] == spec.lr
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
    # the resumed run's schedule (2 steps, decaying linearly to a tenth), not the saved rate (the 1-step run's end)
    assert m2["lr"] == pytest.approx(spec.lr * (0.1 + 0.9 / 2), rel=1e-9)
    assert (weights_dir(run, 2) / COMMIT_MARKER).exists()
    assert (weights_dir(run, 1) / COMMIT_MARKER).stat().st_mtime_ns == v1_mtime


def _adam_moments(checkpoint_dir):
    """{parameter: AdamW's first moment} of a TorchTitan checkpoint: after one step (1 - beta1) x the clipped gradient."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_dir, checkpoint_dir.with_suffix(".pt"))
    optimizer = torch.load(checkpoint_dir.with_suffix(".pt"), weights_only=False)["optimizer"]  # flattened keys
    return {key.removesuffix(".exp_avg"): m for key, m in optimizer.items() if key.endswith(".exp_avg")}


def test_context_parallel_2_takes_the_one_process_step(tiny_checkpoint, tmp_path):
    """`moerl rl --set train.nproc=2 --set train.context_parallel=2`'s trainer: each process trains on its
    head-tail half of every sequence (10 model inputs padded to 12), replaying its half of the record, and
    the step (loss over the global token count, FSDP's gradient sum over the CP group, AdamW) is the
    one-process step: same loss, gradients and updated weights (fp32, published as fp32)."""
    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    metrics, moments, weights = {}, {}, {}
    for cp in (1, 2):
        sets = [f"train.nproc={cp}", f"train.context_parallel={cp}", "train.steps=1", "model.inference_dtype=float32"]
        cfg = RLConfig.from_toml(ROOT / "configs" / "tiny_kimi_k2.toml", parse_overrides(sets))
        run = tmp_path / f"cp{cp}"
        TrainerSpec.from_config(cfg, ckpt).save(run)
        _write_batch(run, 1, model, arch, seed=2, logp_noise=0.5)
        proc = run_torchrun(cp, "-m", "rl_loop.trainer", str(run))
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics[cp] = json.loads(metrics_path(run, 1).read_text())
        moments[cp] = _adam_moments(run / "trainer" / "checkpoint" / "step-1")
        weights[cp] = dict(read_fs(weights_dir(run, 1))[1])
    one, two = metrics[1], metrics[2]
    assert one["tokens"] == two["tokens"] == 20 and one["router_disagreement"] == two["router_disagreement"] == 0.0
    assert 0 < one["masked_frac"] < 1 and abs(one["loss"]) > 1e-3, "off-policy batch: ratios matter, some are masked"
    assert (one["masked_frac"], one["extreme_frac"]) == (two["masked_frac"], two["extreme_frac"])
    # the loss sums per-token terms ratio x advantage of magnitude <= max_ratio x 0.5 = 1: ulps at 1
    for key in ("loss", "mismatch_k3_mean"):
        assert abs(one[key] - two[key]) <= ulp_tol(torch.float32, torch.tensor(1.0), 8), (key, one[key], two[key])
    assert abs(one["grad_norm"] - two["grad_norm"]) <= ulp_tol(torch.float32, torch.tensor(one["grad_norm"]), 8)
    # every parameter's gradient, as AdamW's first moment holds it: the two sum the tokens' terms in other
    # orders, which the host's kernels decide (measured, in ulps of each tensor's largest: <= 33 on the Intel
    # hosts so far, 70.5 on an AMD EPYC with AVX-512); a lost or doubled CP half is off by the gradient itself
    assert moments[1].keys() == moments[2].keys() and len(moments[1]) > 60
    worst = {n: (m - moments[2][n]).abs().max().item() / ulp_tol(torch.float32, m, 1) for n, m in moments[1].items()}
    assert max(worst.values()) <= 256, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    # The updated weights, wherever the gradient is far above AdamW's eps (1e-8), i.e. the step is
    # lr x sign(g) there (|update| > 0.99 lr); nearer eps, Adam's division amplifies the gradients'
    # last-bit differences (those are checked on the moments above).
    original = load_file(ckpt / "model.safetensors")
    assert weights[1].keys() == weights[2].keys() == original.keys()
    checked = 0
    for name, w0 in original.items():
        w1, w2 = weights[1][name], weights[2][name]
        assert w1.dtype == w2.dtype == torch.float32
        firm = (w1 - w0).abs() > 0.99 * cfg.train.lr
        checked += int(firm.sum())
        assert ((w1 - w2).abs() * firm).max().item() <= ulp_tol(torch.float32, w1, 4), name
    assert checked > 0.5 * sum(w.numel() for w in original.values())


def test_chunked_loss_and_offloaded_moments_take_the_plain_steps(tiny_checkpoint, tmp_path):
    """`--set train.loss_chunk_tokens=3` on two FSDP ranks: the LM head and the loss on chunks of 3 positions
    (10 model inputs per sequence padded to 12) give the step of whole-sequence logits: the same loss, metrics
    and updated weights at step 1, and the same run for 5 steps. `--set train.optimizer_offload=true --set
    train.activation_offload=true` (AdamW's moments off the device from each forward to the step, each block's
    input from its forward to its backward) gives the plain run bit for bit."""
    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    metrics, weights = {}, {}
    variants = {0: ["train.loss_chunk_tokens=0"], 3: ["train.loss_chunk_tokens=3"],
                "offload": ["train.optimizer_offload=true", "train.activation_offload=true"]}
    for chunk, variant in variants.items():
        sets = ["train.nproc=2", "train.steps=5", "model.inference_dtype=float32", *variant]
        cfg = RLConfig.from_toml(ROOT / "configs" / "tiny_kimi_k2.toml", parse_overrides(sets))
        run = tmp_path / f"run_{chunk}"
        TrainerSpec.from_config(cfg, ckpt).save(run)
        for step in range(1, 6):
            _write_batch(run, step, model, arch, seed=10 + step, logp_noise=0.5)
        proc = run_torchrun(2, "-m", "rl_loop.trainer", str(run))
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics[chunk] = [json.loads(metrics_path(run, s).read_text()) for s in range(1, 6)]
        weights[chunk] = dict(read_fs(weights_dir(run, 1))[1])
        weights[chunk, 5] = dict(read_fs(weights_dir(run, 5))[1])
    assert [{k: v for k, v in m.items() if not k.endswith("_s")} for m in metrics["offload"]] == [
        {k: v for k, v in m.items() if not k.endswith("_s")} for m in metrics[0]]
    assert all(torch.equal(w, weights["offload", 5][n]) for n, w in weights[0, 5].items())
    keys = ("loss", "mismatch_k3_mean", "mismatch_k3_max", "entropy_mean", "grad_norm")
    for step, (whole, chunked) in enumerate(zip(metrics[0], metrics[3]), 1):
        assert whole["tokens"] == chunked["tokens"] == 20
        assert (whole["masked_frac"], whole["extreme_frac"]) == (chunked["masked_frac"], chunked["extreme_frac"])
        for key in keys:
            # step 1: the two sum the same per-token terms in other orders (ulps at the metric's size); from
            # step 2 on, AdamW has amplified the step-1 weights' last-bit differences where gradients are near
            # its eps (below), so the runs agree to ~1e-5, where a lost or doubled chunk is off by its share
            tol = ulp_tol(torch.float32, torch.tensor(max(1.0, abs(whole[key]))), 16) if step == 1 else 1e-4 * max(
                1.0, abs(whole[key]))
            assert abs(whole[key] - chunked[key]) <= tol, (step, key, whole[key], chunked[key])
    assert metrics[0][0]["entropy_mean"] > 5.0, "a near-uniform tiny policy over 512 tokens"
    # The step-1 weights wherever the gradient is far above AdamW's eps (|update| > 0.99 lr), as in the CP test.
    original = load_file(ckpt / "model.safetensors")
    checked = 0
    for name, w0 in original.items():
        w1, w2 = weights[0][name], weights[3][name]
        firm = (w1 - w0).abs() > 0.99 * cfg.train.lr
        checked += int(firm.sum())
        assert ((w1 - w2).abs() * firm).max().item() <= ulp_tol(torch.float32, w1, 4), name
    assert checked > 0.5 * sum(w.numel() for w in original.values())
