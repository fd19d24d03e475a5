"""moerl's vLLM plugin: per-token expert routing with every response.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process (API server, engine core, workers), possibly more than once, so
it is idempotent and imports vLLM only inside the call: importing
``vllm_ext`` (for example ``vllm_ext.routing.record`` in the RL loop) never
pulls in vLLM or torch.
"""

from __future__ import annotations

__all__ = ["register"]

_registered = False


def register() -> None:
    """Install routing capture (engine side), the response fields (API side) and weight sync.

    Activates, before any model or executor is built in this process, the vLLM runtime
    patches (`patches.vllm_cpu_mla_rope`, `patches.vllm_cpu_portable_kernels`,
    `patches.vllm_executor_reads_every_answer`, `patches.vllm_cpu_shm_reader_naps` where asked for), the
    weight-sync hooks (`vllm_ext.weights`), the routing hooks (`vllm_ext.hooks`) and one
    wrapper per serving method for both (`vllm_ext.serving`). A required patch that no longer
    fits vLLM stops the process (`patches.PatchError`); a skipped optional one is counted in
    `moerl:patches_skipped_total` and named in responses.

    Set MOERL_ROUTING=0 to load the plugin without capture.
    """
    global _registered
    if _registered:
        return
    _registered = True
    import patches
    from patches import (
        vllm_cpu_mla_rope,
        vllm_cpu_portable_kernels,
        vllm_cpu_shm_reader_naps,
        vllm_executor_reads_every_answer,
    )

    from . import hooks, routes, serving
    from .dsa import backend as dsa_backend
    from .metrics import patches_skipped
    from .routing.capture import capture_enabled
    from .weights import register as register_weights

    patches.on_skip(patches_skipped.inc)
    patches.activate([vllm_cpu_mla_rope.PATCH, vllm_cpu_portable_kernels.PATCH, vllm_executor_reads_every_answer.PATCH,
                      vllm_cpu_shm_reader_naps.PATCH,
                      *dsa_backend.PATCHES, *routes.PATCHES])
    weights_on = register_weights()  # weight-transfer backend "moerl", version in responses and /metrics
    routing_on = capture_enabled()
    if routing_on:
        patches.activate(hooks.PATCHES)
    patches.activate(serving.enable(routing_on=routing_on, weights_on=weights_on))
