"""vLLM's ``MooncakeStoreConnector`` with each KV block's routing rows pooled next to it.

Use with ``--kv-transfer-config '{"kv_connector": "MoerlMooncakeStoreConnector",
"kv_connector_module_path": "vllm_ext.kv_pool", "kv_role": "kv_both"}'`` and
``MOONCAKE_CONFIG_PATH`` (``rl_loop.kv_pool`` writes both). Everything about KV is
vLLM's connector as shipped; this subclass adds, in the worker process:

* save: every full block the routing capture publishes (``RoutingStore.on_publish``)
  is encoded with the record codec (``routing.pooled``) and put into the same
  Mooncake store under the block's KV key + ``@moerl-routing``, from a thread of
  its own (the step never waits on the network);
* lookup (``MooncakeStoreWorker.lookup``, which the scheduler asks before
  admitting a request): a prefix block counts as a pool hit only when its routing
  value exists, and the hit is cut at the first block whose value cannot be read
  or does not decode to this model's rows. The rows of the hit blocks are fetched
  there and handed to the ``RoutingStore``, which fills them into the request's
  record exactly as on a local prefix-cache hit. So a request never gets KV from
  the pool without its routing: such a block is recomputed, KV and rows alike.

A lookup that cannot reach the store (``mooncake_master`` down) is a miss: the
replica recomputes. Failed lookups are counted on ``/metrics`` as
``moerl:kv_pool_lookup_failures_total{reason}`` (``unreachable``, ``missing``,
``corrupt``), carried from the worker by vLLM's own connector stats.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult, PoolKey
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStorePromMetrics

from .routing import capture
from .routing.pooled import BlockShape, decode_block, encode_block, routing_key

logger = logging.getLogger("vllm_ext.kv_pool")

__all__ = ["MoerlMooncakeStoreConnector", "RoutingPool", "LOOKUP_FAILURES", "FAILURE_REASONS"]

LOOKUP_FAILURES = ("moerl:kv_pool_lookup_failures", "moerl_kv_pool_lookup_failures")
UNREACHABLE, MISSING, CORRUPT = "unreachable", "missing", "corrupt"
FAILURE_REASONS = (UNREACHABLE, MISSING, CORRUPT)
# connector-stats operations of this module (status "ok" or a failure reason)
OP_LOOKUP, OP_GET, OP_PUT = "routing_lookup", "routing_get", "routing_put"


class RoutingPool:
    """Routing rows of KV blocks in the connector's Mooncake store (worker process)."""

    def __init__(self, worker: Any) -> None:
        prefixes = worker._lookup_key_prefixes  # noqa: SLF001
        if len(prefixes) != 1 or len(prefixes[0]) != 1 or worker.block_size != worker.hash_block_size:
            raise ValueError("moerl's routing pool needs one KV cache group in one key namespace, hashed per "
                             f"block (groups {len(prefixes)}, block {worker.block_size}, hash block "
                             f"{worker.hash_block_size})")
        self.worker = worker
        self.store = worker.store
        self.prefix = prefixes[0][0]
        self.block_size = int(worker.block_size)
        self._orig_lookup = worker.lookup
        worker.lookup = self.lookup
        self.routing: Any = None  # the worker's WorkerRouting, once the capture is bound
        self.shape: BlockShape | None = None
        self._puts: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._put_loop, name="moerl-routing-put", daemon=True).start()

    def attach(self, routing: Any) -> None:
        """Bind to the capture: publish its blocks into the pool, fill hits into its store."""
        cap = routing.capture
        if routing.store.block_size != self.block_size:
            raise ValueError(f"routing block size {routing.store.block_size} != KV block size {self.block_size}")
        self.shape = BlockShape(self.block_size, tuple(cap.moe_layers), int(cap.num_experts), int(cap.top_k))
        self.routing = routing
        routing.store.on_publish = self.published

    def key(self, block_hash: bytes | memoryview) -> str:
        return routing_key(PoolKey.build_key_string(self.prefix, block_hash.hex()))

    def _record(self, op: str, t0: float, keys: int, status: str = "ok", failed: int = 0, nbytes: int = 0) -> None:
        self.worker._record_kv_connector_operation(  # noqa: SLF001
            op, time.perf_counter() - t0, keys, num_bytes=nbytes, status=status, num_failed_keys=failed)

    # ---------------------------------------------------------------- save

    def published(self, block_hash: bytes, index: int, rows: bytes) -> None:
        """A block's rows are complete on this replica (step thread): queue its put."""
        self._puts.put((block_hash, index, rows))

    def _put_loop(self) -> None:
        import numpy as np

        while True:
            batch = [self._puts.get()]
            while len(batch) < 256 and not self._puts.empty():
                batch.append(self._puts.get())
            shape = self.shape
            dims = (shape.block_size, len(shape.moe_layers), shape.top_k)
            dtype = self.routing.store.dtype
            keys = [self.key(h) for h, _, _ in batch]
            values = [encode_block(np.frombuffer(rows, dtype).reshape(dims), shape, i) for _, i, rows in batch]
            t0 = time.perf_counter()
            try:
                rc = self.store.put_batch(keys, values)
            except Exception as exc:  # noqa: BLE001 - the store's errors are not typed
                rc = exc
            if rc not in (0, None):
                logger.warning("moerl kv pool: routing of %d blocks not pooled (%s); they will be recomputed "
                               "where they are missed", len(keys), rc)
            self._record(OP_PUT, t0, len(keys), "ok" if rc in (0, None) else UNREACHABLE,
                         0 if rc in (0, None) else len(keys), sum(len(v) for v in values))

    # ---------------------------------------------------------------- lookup

    def lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> MooncakeLookupResult:
        """vLLM's lookup, restricted to the leading blocks whose routing is pooled and intact."""
        routing, bs = self.routing, self.block_size
        n = min(len(block_hashes), (num_tokens - 1) // bs)  # the last token is always computed
        if routing is None or n <= 0:
            return MooncakeLookupResult(0)
        keys = [self.key(h) for h in block_hashes[:n]]
        t0 = time.perf_counter()
        try:
            codes = self.store.batch_is_exist(keys)
        except Exception:  # noqa: BLE001
            codes = [-1] * n
        if any(c < 0 for c in codes):
            self._record(OP_LOOKUP, t0, n, UNREACHABLE, sum(c < 0 for c in codes))
            return MooncakeLookupResult(0)
        self._record(OP_LOOKUP, t0, n)
        have = next((i for i, c in enumerate(codes) if c != 1), n)
        if have == 0:
            return MooncakeLookupResult(0)
        res = self._orig_lookup(num_tokens if have == n else have * bs + 1, block_hashes[:have])
        hit = res.hit_length // bs
        good = self._fetch(block_hashes[:hit])
        if good < hit:
            res = self._orig_lookup(good * bs + 1, block_hashes[:good]) if good else MooncakeLookupResult(0)
        return res

    def _fetch(self, block_hashes: Sequence[Any]) -> int:
        """Load the rows of the blocks the store lacks; how many leading blocks have rows."""
        store = self.routing.store
        need = [(i, bytes(h)) for i, h in enumerate(block_hashes) if not store.has_block(bytes(h))]
        if not need:
            return len(block_hashes)
        t0 = time.perf_counter()
        try:
            values = self.store.get_batch([self.key(h) for _, h in need])
        except Exception:  # noqa: BLE001
            values = [b""] * len(need)
        for k, ((i, h), value) in enumerate(zip(need, values)):
            try:
                rows = decode_block(value, self.shape, i)
            except ValueError as exc:
                reason = MISSING if not value else CORRUPT
                logger.warning("moerl kv pool: block %d of a prefix is a miss: its routing is %s (%s)", i, reason, exc)
                self._record(OP_GET, t0, k + 1, reason, 1, sum(len(v) for v in values[:k]))
                return i
            store.add_block(h, rows.astype(store.dtype, copy=False))
        self._record(OP_GET, t0, len(need), nbytes=sum(len(v) for v in values))
        return len(block_hashes)


class MoerlPromMetrics(MooncakeStorePromMetrics):
    """vLLM's Mooncake store metrics plus moerl's count of failed pool lookups (by reason)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        doc = "Pool lookups that became a recompute: store unreachable, or routing rows missing or corrupt"
        self._failures = {}
        for name in LOOKUP_FAILURES:
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames + ["reason"])
            for engine, values in per_engine_labelvalues.items():
                for reason in FAILURE_REASONS:
                    self._failures[(name, engine, reason)] = counter.labels(*values, reason)

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for op in (OP_LOOKUP, OP_GET):
            for record in (transfer_stats_data or {}).get(op, ()):
                if record["status"] in FAILURE_REASONS:
                    for name in LOOKUP_FAILURES:
                        self._failures[(name, engine_idx, record["status"])].inc()


class MoerlMooncakeStoreConnector(MooncakeStoreConnector):
    """``MooncakeStoreConnector`` whose pool hits carry their routing rows (see the module doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self.connector_worker
        if worker is not None and not worker._capacity_only and worker.lookup_server is not None:  # noqa: SLF001
            capture.attach_pool(RoutingPool(worker))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MoerlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
