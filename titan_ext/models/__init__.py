"""titan_ext's model registry: model name -> flavors -> TorchTitan ModelSpec."""

from __future__ import annotations

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.protocols.model_spec import ModelSpec

from . import glm5, kimi_k2
from .arch import MLAMoEArch
from .builder import AttnBackend, build_model_config
from .state_dict_adapter import MLAMoEStateDictAdapter

ARCHS: dict[str, dict[str, MLAMoEArch]] = {
    "kimi_k2": kimi_k2.FLAVORS,
    "glm5": glm5.FLAVORS,
}


class UnknownModelError(ValueError):
    pass


def get_arch(model: str, flavor: str) -> MLAMoEArch:
    if model not in ARCHS:
        raise UnknownModelError(f"unknown model {model!r}; titan_ext has: {', '.join(sorted(ARCHS))}")
    if flavor not in ARCHS[model]:
        raise UnknownModelError(
            f"unknown flavor {flavor!r} for model {model!r}; it has: {', '.join(sorted(ARCHS[model]))}"
        )
    return ARCHS[model][flavor]


def spec_from_arch(name: str, flavor: str, arch: MLAMoEArch, *, attn_backend: AttnBackend = "sdpa") -> ModelSpec:
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=build_model_config(arch, attn_backend=attn_backend),
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=MLAMoEStateDictAdapter,
    )


def model_spec(model: str, flavor: str, *, attn_backend: AttnBackend = "sdpa") -> ModelSpec:
    return spec_from_arch(model, flavor, get_arch(model, flavor), attn_backend=attn_backend)
