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
    """Install routing capture (engine side) and the response field (API side).

    Also applies the vLLM runtime patches this process needs (`patches.vllm_cpu_mla_rope`,
    `patches.vllm_executor_reads_every_answer`).

    Set MOERL_ROUTING=0 to load the plugin without capture.
    """
    global _registered
    if _registered:
        return
    _registered = True
    from patches import vllm_cpu_mla_rope, vllm_executor_reads_every_answer

    for patch in (vllm_cpu_mla_rope.PATCH, vllm_executor_reads_every_answer.PATCH):
        if patch.needed():  # before any model or executor is built in this process
            patch.apply()
    from .weights import register as register_weights

    register_weights()  # weight-transfer backend "moerl", version in responses and /metrics
    from .routing.capture import capture_enabled

    if not capture_enabled():
        return
    from . import api, hooks

    hooks.install()
    api.install()
