"""Block-fp8 (titan_ext.models.block_fp8): the quantizer against a per-block definition, the
dequantization against transformers', checkpoints written and read back bit for bit, and
corrupted or incomplete checkpoints refused with the tensor's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_ext.checkpoint import checkpoint_quantization, export_hf_checkpoint, load_hf_checkpoint
from titan_ext.models.block_fp8 import (
    FP8, SCALE_SUFFIX, BlockFp8Config, BlockFp8Error, dequantize, quantize, quantize_torch, scale_shape)
from titan_ext.weights import hf_metadata, iter_hf_weights


def _per_block(w: torch.Tensor, block=(128, 128)):
    """The format's definition, one block at a time (vLLM's per_block_cast_to_fp8 rounding)."""
    m, n = w.shape
    rows, cols = -(-m // block[0]), -(-n // block[1])
    q = torch.empty(m, n, dtype=FP8)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            x = w[sl].float()
            s[i, j] = x.abs().max().clamp(min=1e-4) / 448.0
            q[sl] = (x * (1.0 / s[i, j])).clamp(-448, 448).to(FP8)
    return q, s


def _weights(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of unequal range, so blocks have different scales
    return (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 0.2).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(576, 128), (200, 300), (128, 256), (32, 7)])
def test_quantize_is_the_per_block_definition(shape):
    w = _weights(*shape)
    zero_block = shape[0] > 128
    if zero_block:
        w[:128, :128] = 0  # an all-zero block: finite scale, zeros
    q, s = quantize(w)
    want_q, want_s = _per_block(w)
    assert s.shape == scale_shape(shape) and s.dtype == torch.float32
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if zero_block:
        assert (q[:128, :128].float() == 0).all() and s[0, 0] == 1e-4 / 448
    # the largest magnitude maps onto the top of the e4m3 range
    assert q.float().abs().amax() == 448.0


def test_stacked_experts_quantize_as_separate_matrices():
    w = _weights(5, 130, 200, seed=1)
    q, s = quantize(w)
    for e in range(5):
        qe, se = quantize_torch(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)


def test_dequantize_is_the_reference_formula_and_matches_transformers_where_it_can():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    for shape in [(256, 384), (32, 128), (80, 64)]:  # blocks that divide, or a single cut block
        q, s = quantize(_weights(*shape, seed=2))
        ours = dequantize(q, s)
        theirs = Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)
        assert torch.equal(ours, theirs)
        i, j = shape[0] - 1, shape[1] - 1
        assert ours[i, j] == q[i, j].float() * s[i // 128, j // 128]


def test_transformers_dequantize_gets_cut_edge_blocks_wrong():
    """Why check-parity's fp8 reference dequantizes with our formula (titan_ext/parity.py);
    fails once transformers handles a last block that 128 does not divide."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = quantize(_weights(192, 64, seed=3))
    assert not torch.equal(Fp8Dequantize(None)._dequantize_one(q, s, torch.float32), dequantize(q, s))
    q, s = quantize(_weights(576, 128, seed=3))
    with pytest.raises(ValueError, match="not divisible"):
        Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)


def test_non_finite_weight_is_refused():
    w = _weights(130, 130)
    w[129, 3] = float("nan")
    with pytest.raises(BlockFp8Error, match="layers.0.w: non-finite"):
        quantize(w, name="layers.0.w")


def test_config_parsing():
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    quant = BlockFp8Config.from_hf_config(cfg)
    assert quant == BlockFp8Config() and BlockFp8Config.from_hf_config({"quantization_config": quant.to_hf()}) == quant
    assert BlockFp8Config.from_hf_config({}) is None
    with pytest.raises(BlockFp8Error, match="per-tensor"):
        BlockFp8Config.from_hf_config({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(BlockFp8Error, match="'awq'"):
        BlockFp8Config.from_hf_config({"quantization_config": {"quant_method": "awq"}})
    assert quant.quantizes("model.layers.3.mlp.experts.7.up_proj.weight", (32, 128))
    assert not quant.quantizes("model.layers.3.mlp.gate.weight", (64, 128))
    assert not quant.quantizes("model.layers.3.self_attn.indexer.weights_proj.weight", (8, 128))
    assert not quant.quantizes("model.embed_tokens.weight", (512, 128))
    assert not quant.quantizes("model.layers.3.input_layernorm.weight", (128,))


@pytest.fixture(scope="module")
def bf16_kimi(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("kimi_k2", tmp_path_factory.mktemp("bf16") / "kimi", dtype="bfloat16", init_scale=0.1)
    return ckpt, load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def fp8_export(bf16_kimi, tmp_path_factory):
    """The bf16 checkpoint loaded (fp32) and exported in block fp8 as 2 shards."""
    model, arch = load_hf_checkpoint(bf16_kimi[0], "kimi_k2")
    out = export_hf_checkpoint(model, arch, tmp_path_factory.mktemp("fp8") / "kimi", quant=BlockFp8Config(),
                               dtype=torch.bfloat16, max_shard_bytes=1 << 20)
    return model, arch, out


def _read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in ckpt.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_bf16_to_block_fp8_export_to_load_is_the_reference_dequantization(bf16_kimi, fp8_export):
    _, bf16 = bf16_kimi
    model, _, out = fp8_export
    assert checkpoint_quantization(out) == BlockFp8Config()
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    written = _read_all(out)
    quant = BlockFp8Config()
    quantized = {k for k, v in bf16.items() if quant.quantizes(k, tuple(v.shape))}
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in quantized  # [576, 128]: a cut edge block
    assert set(written) == set(bf16) | {k + SCALE_SUFFIX for k in quantized}
    for k in quantized:
        q, s = quantize_torch(bf16[k])
        assert written[k].dtype == FP8 and torch.equal(written[k].view(torch.uint8), q.view(torch.uint8)), k
        assert torch.equal(written[k + SCALE_SUFFIX], s), k
    reloaded, _ = load_hf_checkpoint(out, "kimi_k2")
    from titan_ext.weights import adapter_for

    got = adapter_for(reloaded).to_hf(reloaded.state_dict())
    for k, v in bf16.items():
        want = dequantize(*quantize_torch(v)) if k in quantized else v.float()
        assert torch.equal(got[k], want), k


def test_weight_stream_in_block_fp8_equals_the_export(fp8_export):
    model, _, out = fp8_export
    quant = BlockFp8Config()
    items = list(iter_hf_weights(model, dtype=torch.bfloat16, quant=quant))
    assert [(k, v.dtype, tuple(v.shape)) for k, v in items] == hf_metadata(model, dtype=torch.bfloat16, quant=quant)
    written = _read_all(out)
    assert len(items) == len(written)
    for k, v in items:
        assert v.dtype == written[k].dtype and torch.equal(v.view(torch.uint8), written[k].view(torch.uint8)), k
    names = [k for k, _ in items]
    w = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert names.index(w + SCALE_SUFFIX) == names.index(w) + 1


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            sd = load_file(str(f))
            edit(sd)
            save_file(sd, str(dst / f.name))
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("corruption,message", [
    ("nan", "1 of 1 block scales are not positive finite"),
    ("zero", "are not positive finite"),
    ("shape", "needs (1, 1)"),
    ("missing", "has no model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"),
])
def test_corrupted_or_missing_scale_is_refused_with_its_name(fp8_export, tmp_path, corruption, message):
    _, _, out = fp8_export
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    scale = name + SCALE_SUFFIX

    def edit(sd):
        if scale not in sd:
            return
        if corruption == "nan":
            sd[scale] = torch.full_like(sd[scale], float("nan"))
        elif corruption == "zero":
            sd[scale] = torch.zeros_like(sd[scale])
        elif corruption == "shape":
            sd[scale] = torch.ones(2, 1)
        else:
            del sd[scale]

    bad = _edited_copy(out, tmp_path / "bad", edit)
    if corruption == "missing":  # the index must not list it either, or the index check fires first
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        del index["weight_map"][scale]
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BlockFp8Error) as err:
        load_hf_checkpoint(bad, "kimi_k2")
    assert (scale if corruption != "missing" else name) in str(err.value) and message in str(err.value)


def test_fp8_weights_without_quantization_config_are_refused(fp8_export, tmp_path):
    _, _, out = fp8_export
    bad = _edited_copy(out, tmp_path / "noconf", lambda sd: None)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BlockFp8Error, match="is fp8 but config.json has no block-fp8 quantization_config"):
        load_hf_checkpoint(bad, "kimi_k2")
