"""Weight sync for vLLM replicas: the ``moerl`` weight-transfer backend and its protocol.

Pieces (capture -> ship -> apply, by file), each importing only those listed
before it:

* ``format.py``: what both transports share, no vLLM import: ``TensorMeta``
  (name, dtype, shape), the one error type ``WeightUpdateError``, checksums
  (xxh3-64) and the check of an update against the served model's layout;
* ``wire.py``: the filesystem transport, both ends (safetensors shards +
  ``moerl_commit.json`` with checksums, written last);
* ``shm.py``: the same-host shared-memory ring that carries a streamed
  update's bytes when sender and receiver share a host;
* ``channel.py``: the TCPStore handshake and gloo process groups between a
  sender and its receivers, kept across updates;
* ``stream.py``: the streaming transport over torch.distributed, both ends
  (control on ``channel.py``, bytes through ``shm.py`` or gloo broadcasts);
* ``peak_rss.py``: the peak resident memory of a stretch of work (the bound a
  sharded update promises, logged by the engine and held to in a test);
* ``plan.py`` and ``sharded.py``: the resharding plan (which trainer rank sends
  which box to which replica worker, experts stacked on the wire) and the
  sharded transport that carries it;
* ``reload.py``: applying an update to the served model: vLLM's layerwise
  reload, each MoE layer's experts loaded as one stack per projection;
* ``engine.py``: the vLLM worker-side ``WeightTransferEngine`` (backend name
  ``moerl``): receive, check against the served checkpoint's layout, apply
  (``reload.py``), roll back on failure;
* ``api.py``: policy version in every completion/chat response, update state on
  ``/metrics`` (``vllm_ext.metrics``);
* ``swap.py``: the API server's ``/moerl/swap_weights`` route, a sharded update's
  pause -> apply -> finish -> resume in one request;
* ``client.py``: the trainer-side driver (HTTP, stdlib only): pause(keep) ->
  start -> update -> finish(version) -> resume, for one or many replicas; on the
  sharded lanes start and the bytes first, while the replicas serve, then the swap.

``register()`` (called from ``vllm_ext.register``) registers the backend with
``WeightTransferEngineFactory`` lazily (the engine module is imported only when
a server selects ``--weight-transfer-config '{"backend": "moerl"}'``), applies
``patches.vllm_cpu_moe_reload_prepack`` once vLLM's MoE layer is loaded, and
installs the API hooks. Idempotent; imports vLLM only inside the call.
"""

from __future__ import annotations

import logging
import os

BACKEND = "moerl"

__all__ = ["BACKEND", "register"]

logger = logging.getLogger("vllm_ext.weights")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    if os.environ.get("MOERL_WEIGHTS", "1") == "0":
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001 (no public lookup)
        WeightTransferEngineFactory.register_engine(BACKEND, "vllm_ext.weights.engine", "MoerlWeightTransferEngine")
    try:
        from . import api

        api.install()
    except Exception as exc:  # an engine-core or worker process without the API stack
        logger.debug("moerl weights: API hooks not installed here: %s", exc)
