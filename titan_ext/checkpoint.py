"""Load HF safetensors checkpoints into titan_ext models and export them back.

This is the single-process path used by `moerl check-parity`, tests and tools; the
distributed trainer loads through TorchTitan's checkpointer with the same adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .models import ARCHS, Arch, arch_from_hf_config, get_arch, spec_from_arch, state_dict_adapter_cls

_HF_ARCH_OF_MODEL = {name: flavors["full"].hf_architecture for name, flavors in ARCHS.items()}


def _config_json(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --hf-checkpoint must be an HF model directory")
    return json.loads(path.read_text())


def model_of_checkpoint(ckpt_dir: str | Path) -> str:
    """The titan_ext model name for the architecture in `ckpt_dir/config.json`."""
    hf_arch = (_config_json(ckpt_dir).get("architectures") or ["?"])[0]
    for name, want in _HF_ARCH_OF_MODEL.items():
        if want == hf_arch:
            return name
    raise ValueError(f"{ckpt_dir}: architecture {hf_arch!r} is not one titan_ext ports; "
                     f"supported: {sorted(set(_HF_ARCH_OF_MODEL.values()))}")


def read_arch(ckpt_dir: str | Path, model: str) -> Arch:
    """The architecture in `ckpt_dir/config.json`, checked against the titan_ext model name."""
    get_arch(model, "full")  # raises UnknownModelError listing the models
    path = Path(ckpt_dir) / "config.json"
    arch = arch_from_hf_config(_config_json(ckpt_dir))
    if arch.hf_architecture != _HF_ARCH_OF_MODEL[model]:
        raise ValueError(
            f"{path} describes {arch.hf_architecture}, but --model {model} expects {_HF_ARCH_OF_MODEL[model]}"
        )
    return arch


def _safetensors_files(ckpt_dir: Path) -> list[Path]:
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    return files


def load_hf_checkpoint(ckpt_dir: str | Path, model: str):
    """Build the titan_ext model (fp32) described by the checkpoint and load its weights.

    Returns (model, arch). Shapes are checked before any tensor is read, so a wrong
    checkpoint fails fast with the names of what is missing, extra or mis-shaped.
    """
    ckpt_dir = Path(ckpt_dir)
    arch = read_arch(ckpt_dir, model)
    spec = spec_from_arch(model, "checkpoint", arch)
    with torch.device("meta"):
        meta_model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    expected = {k: tuple(v.shape) for k, v in adapter.to_hf(meta_model.state_dict()).items()}
    handles = [safe_open(str(f), "pt") for f in _safetensors_files(ckpt_dir)]
    shapes = {k: tuple(h.get_slice(k).get_shape()) for h in handles for k in h.keys()}
    adapter.check_hf_shapes(shapes, expected)
    hf_sd = {k: h.get_tensor(k).float() for h in handles for k in h.keys() if k in expected}
    titan_model = spec.model.build()
    titan_model.load_state_dict(adapter.from_hf(hf_sd), strict=True)
    return titan_model.eval(), arch


def write_hf_checkpoint(state_dict: dict[str, torch.Tensor], model_config, arch: Arch,
                        out_dir: str | Path) -> Path:
    """Write a titan_ext state dict (plain tensors) as an HF checkpoint transformers and vLLM load."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = state_dict_adapter_cls(arch)(model_config, None).to_hf({k: v.detach() for k, v in state_dict.items()})
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = arch.to_hf_config()
    cfg["torch_dtype"] = str(next(iter(hf_sd.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def export_hf_checkpoint(titan_model: torch.nn.Module, arch: Arch, out_dir: str | Path) -> Path:
    """Write a single-process model as an HF checkpoint (config.json + model.safetensors)."""
    return write_hf_checkpoint(titan_model.state_dict(), titan_model.config, arch, out_dir)
