"""titan_ext vs transformers on real HF checkpoints made locally (acceptance 3 and 5 of the foundation)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_moerl
from titan_ext.checkpoint import export_hf_checkpoint, load_hf_checkpoint
from titan_ext.models.state_dict_adapter import CheckpointMismatchError


def _check_parity(ckpt, model, *extra):
    out = run_moerl("check-parity", "--hf-checkpoint", str(ckpt), "--model", model, "--json", *extra)
    return out.returncode, json.loads(out.stdout) if out.stdout.strip().startswith("{") else out.stderr


@pytest.mark.parametrize("init_scale", [0.02, 0.1])
def test_kimi_k2_parity(tiny_checkpoint, init_scale):
    code, report = _check_parity(tiny_checkpoint("kimi_k2", init_scale), "kimi_k2", "--seq-len", "64")
    assert code == 0 and report["passed"], report
    assert report["max_abs_logit_diff"] <= 1e-4 and report["argmax_agreement"] == 1.0


@pytest.mark.parametrize("init_scale", [0.02, 0.1])
def test_glm5_parity_with_sparse_attention_exercised(tiny_checkpoint, init_scale):
    ckpt = tiny_checkpoint("glm5", init_scale)
    model, arch = load_hf_checkpoint(ckpt, "glm5")
    seq_len = 4 * arch.index_topk
    code, report = _check_parity(ckpt, "glm5", "--seq-len", str(seq_len))
    assert code == 0 and report["passed"], report
    # The indexer really drops keys at this length: attending to all keys changes the output.
    tokens = torch.randint(0, arch.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sparse = model(tokens)
        for layer in model.layers.values():
            layer.attention.indexer.topk = seq_len
        dense = model(tokens)
    assert (sparse - dense).abs().max() > 1e-3


def test_tolerance_is_enforced(tiny_checkpoint):
    code, report = _check_parity(tiny_checkpoint("kimi_k2"), "kimi_k2", "--tolerance", "0")
    assert code == 1 and not report["passed"] and report["max_abs_logit_diff"] > 0


@pytest.mark.parametrize("model", ["kimi_k2", "glm5"])
def test_export_round_trip_is_identical_in_transformers(tiny_checkpoint, tmp_path, model):
    import transformers

    src = tiny_checkpoint(model, 0.1)
    titan_model, arch = load_hf_checkpoint(src, model)
    out = export_hf_checkpoint(titan_model, arch, tmp_path / "export")
    original, exported = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for k in original:
        assert torch.equal(original[k], exported[k]), k
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    a, b = ref.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _broken_copy(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_missing_extra_and_misshaped_tensors_are_named(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("kimi_k2")
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    misshaped = "model.layers.1.self_attn.kv_b_proj.weight"

    def edit(sd):
        del sd[missing]
        sd["model.layers.1.mlp.experts.0.bias"] = torch.zeros(3)
        sd[misshaped] = sd[misshaped][:-1]

    bad = _broken_copy(src, tmp_path / "bad", edit)
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_checkpoint(bad, "kimi_k2")
    msg = str(err.value)
    assert "1 missing" in msg and missing in msg
    assert "1 unexpected" in msg and "experts.0.bias" in msg
    assert "1 mis-shaped" in msg and misshaped in msg
    code, stderr = _check_parity(bad, "kimi_k2")
    assert code == 2 and missing in stderr


def test_checkpoint_of_another_model_is_refused(tiny_checkpoint):
    code, stderr = _check_parity(tiny_checkpoint("glm5"), "kimi_k2")
    assert code == 2 and "GlmMoeDsaForCausalLM" in stderr
    code, stderr = _check_parity(tiny_checkpoint("qwen3_moe"), "kimi_k2")
    assert code == 2 and "Qwen3MoeForCausalLM" in stderr


def test_a_truncated_or_damaged_file_and_a_length_past_the_context_are_one_line(tiny_checkpoint, tmp_path):
    import shutil

    src = tiny_checkpoint("glm5")
    for damage in ("truncated", "not safetensors"):
        bad = tmp_path / damage.replace(" ", "_")
        shutil.copytree(src, bad)
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\0" * 64)
        code, stderr = _check_parity(bad, "glm5")
        assert code == 2 and "Traceback" not in stderr, stderr
        assert f"{bad / 'model.safetensors'}: damaged or truncated safetensors file" in stderr
    train = subprocess.run([str(Path(sys.executable).with_name("torchtitan")), "train", "--extension", "titan_ext",
                            "--model", "glm5",
                            "--flavor", "tiny", "--checkpoint.enable", "--checkpoint.initial_load_path", str(bad),
                            "--checkpoint.initial_load_in_hf", "--training.steps", "1",
                            "--dump_folder", str(tmp_path / "out")], capture_output=True, text=True)
    assert train.returncode == 2 and "Traceback" not in train.stderr, train.stderr[-2000:]
    assert "damaged or truncated safetensors file" in train.stderr
    context = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    code, stderr = _check_parity(src, "glm5", "--seq-len", str(context + 1))
    assert code == 2 and "Traceback" not in stderr and f"context is {context} tokens" in stderr, stderr
