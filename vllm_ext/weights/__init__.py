"""The receiving end of weight sync inside vLLM: the ``moerl`` weight-transfer backend.

The transport itself (formats, the filesystem, shared-memory, streaming and sharded
lanes, the resharding plan, the trainer-side HTTP driver) lives in
``vllm_ext.transport``, which imports no vLLM; this package adapts it to vLLM's
worker and API server, by file:

* ``served.py``: the policy version of the weights this worker's model holds, and who
  is told when it changes (the KV pool's key namespace);
* ``reload.py``: applying an update to the served model: vLLM's layerwise reload, each
  MoE layer's experts loaded as one stack per projection;
* ``engine.py``: the vLLM worker-side ``WeightTransferEngine`` (backend name
  ``moerl``): receive (any ``vllm_ext.transport`` lane), check against the served
  checkpoint's layout, apply (``reload.py``), roll back on failure;
* ``api.py``: policy version in every completion/chat response, update state on
  ``/metrics`` (``vllm_ext.metrics``);
* ``swap.py``: the API server's ``/moerl/swap_weights`` route, a sharded update's
  pause -> apply -> finish -> resume in one request.

``register()`` (called from ``vllm_ext.register``) registers the backend with
``WeightTransferEngineFactory`` lazily (the engine module is imported only when
a server selects ``--weight-transfer-config '{"backend": "moerl"}'``) and activates
the AsyncLLM patches (``api.PATCHES``; its route: ``vllm_ext.routes``); the engine
activates ``patches.vllm_cpu_moe_reload_prepack`` once vLLM's MoE layer is loaded.
Idempotent; imports vLLM only inside the call.
"""

from __future__ import annotations

import os

import patches

BACKEND = "moerl"

__all__ = ["BACKEND", "register"]

_registered = False


def register() -> bool:
    """Register the backend and install the API server's hooks, unless MOERL_WEIGHTS=0; returns
    whether weight sync is on (then responses carry the policy version: ``vllm_ext.serving``)."""
    global _registered
    if os.environ.get("MOERL_WEIGHTS", "1") == "0":
        return False
    if _registered:
        return True
    _registered = True
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001 (no public lookup)
        WeightTransferEngineFactory.register_engine(BACKEND, "vllm_ext.weights.engine", "MoerlWeightTransferEngine")
    from ..metrics import state
    from . import api

    state.install()
    patches.activate(api.PATCHES)
    return True
