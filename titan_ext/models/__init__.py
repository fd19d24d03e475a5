"""titan_ext's model registry: model name -> flavors -> TorchTitan ModelSpec.

Two families: the MLA + MoE models (Kimi-K2, GLM-5: `MLAMoEArch`, built on TorchTitan's
DeepSeek-V3 blocks) and Qwen3-MoE (`Qwen3MoEArch`, on TorchTitan's Qwen3 blocks). Everything
else (checkpoint loading, parity, info) goes through `spec_from_arch` / `arch_from_hf_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import glm5, kimi_k2, qwen3_moe
from .arch import MLAMoEArch
from .qwen3_moe import Qwen3MoEArch

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

    from .builder import AttnBackend

Arch = MLAMoEArch | Qwen3MoEArch

ARCHS: dict[str, dict[str, Arch]] = {
    "kimi_k2": kimi_k2.FLAVORS,
    "glm5": glm5.FLAVORS,
    "qwen3_moe": qwen3_moe.FLAVORS,
}


class UnknownModelError(ValueError):
    pass


def get_arch(model: str, flavor: str) -> Arch:
    if model not in ARCHS:
        raise UnknownModelError(f"unknown model {model!r}; titan_ext has: {', '.join(sorted(ARCHS))}")
    if flavor not in ARCHS[model]:
        raise UnknownModelError(
            f"unknown flavor {flavor!r} for model {model!r}; it has: {', '.join(sorted(ARCHS[model]))}"
        )
    return ARCHS[model][flavor]


def check_context_parallel(model: str) -> None:
    """Raise unless titan_ext's context parallel runs `model`: it shards MLA attention (Kimi-K2,
    GLM-5) by gathering latents; other attention would get TorchTitan's per-head CP, whose batch
    layout the RL trainer does not produce."""
    cp_models = sorted(name for name, flavors in ARCHS.items()
                       if all(isinstance(a, MLAMoEArch) for a in flavors.values()))
    if model not in cp_models:
        raise ValueError(f"context parallel runs titan_ext's MLA models ({', '.join(cp_models)}), "
                         f"not {model!r}")


def arch_from_hf_config(cfg: dict) -> Arch:
    """The titan_ext architecture a transformers `config.json` dict describes (ValueError if none)."""
    if (cfg.get("architectures") or ["?"])[0] == qwen3_moe.HF_ARCHITECTURE:
        return Qwen3MoEArch.from_hf_config(cfg)
    return MLAMoEArch.from_hf_config(cfg)


def state_dict_adapter_cls(arch: Arch) -> type:
    """The HF <-> titan_ext state-dict adapter class of `arch`'s family."""
    if isinstance(arch, Qwen3MoEArch):
        from .qwen3_moe.model import Qwen3MoEStateDictAdapter

        return Qwen3MoEStateDictAdapter
    from .state_dict_adapter import MLAMoEStateDictAdapter

    return MLAMoEStateDictAdapter


def spec_from_arch(name: str, flavor: str, arch: Arch, *, attn_backend: AttnBackend = "sdpa") -> ModelSpec:
    """TorchTitan's ModelSpec of `arch`. TorchTitan is imported here, not with this package: the
    registry above is all that `moerl plan` and `torchtitan list` read."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.model_spec import ModelSpec

    if isinstance(arch, Qwen3MoEArch):
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as parallelize

        from .qwen3_moe.model import build_model_config
    else:
        from .builder import build_model_config
        from .parallelize import parallelize_mla as parallelize
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=build_model_config(arch, attn_backend=attn_backend),
        parallelize_fn=parallelize,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=state_dict_adapter_cls(arch),
    )


def model_spec(model: str, flavor: str, *, attn_backend: AttnBackend = "sdpa") -> ModelSpec:
    return spec_from_arch(model, flavor, get_arch(model, flavor), attn_backend=attn_backend)
