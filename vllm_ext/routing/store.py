"""Where captured routing rows wait until the API server takes them (numpy only).

Two structures, both plain and testable without vLLM:

* per request, rows indexed by token *position* (not appended), in the
  request's shared-memory segment (``handoff.py``): a chunked prefill writes
  successive ranges, and a preempted request that recomputes simply
  overwrites the same positions, so the record stays one row per position
  whatever the scheduler did;
* a bounded LRU of full KV blocks keyed by the scheduler's block hash. A
  prefix-cache hit skips the forward for the cached tokens, so the capture
  never sees them; their rows come from the block the earlier request
  published under the same hash (equal hash = equal tokens and prefix, so
  equal routing), exactly like vLLM's own store. They are filled in at the
  request's first write, before any output of it can finish. With a shared
  KV pool (``vllm_ext.kv_pool``), each newly published block is also handed to
  ``on_publish`` (which pools it next to its KV), and blocks loaded from the
  pool are added with ``add_block`` before the request that hit them runs.

The first position handed over follows vLLM's routed-experts contract: the
requested prompt position (``routed_experts_prompt_start``), up to the last
token fed forward (the last sampled token never is).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .handoff import RowsSegment, SegmentReaper, segment_name

__all__ = ["RoutingStore"]


@dataclass(slots=True)
class _RequestRows:
    seg: RowsSegment
    first_write: bool = True
    published_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


class RoutingStore:
    """Per-request position-indexed rows (one hand-off segment each) plus an LRU of rows by block hash."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype | str, block_size: int, token: str,
                 max_blocks: int = 65536, reaper: SegmentReaper | None = None, kind: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.top_k = top_k
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.token = token
        self.kind = kind  # `handoff.segment_name`'s: "" for expert ids, "index" for indexer keys
        self.max_blocks = max_blocks
        self.reaper = reaper or SegmentReaper()
        self._requests: dict[str, _RequestRows] = {}
        self._lost: set[str] = set()  # scheduled requests that have no segment to write (see `lose`)
        self._pending_hashes: dict[str, list[bytes]] = {}
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # block hash -> its rows
        # (block hash, block index, its rows) of every newly published block
        self.on_publish: Callable[[bytes, int, bytes], None] | None = None
        self._loaded: deque[tuple[bytes, bytes]] = deque()  # pooled blocks not yet in _blocks (any thread adds)

    def open(self, req_id: str, start: int, capacity: int) -> None:
        """A newly scheduled request: rows from position `start` on are handed over, at most
        `capacity` positions (prompt + max new tokens). Opening an open request does nothing."""
        if req_id in self._requests:
            return
        if not 0 <= start <= capacity:
            raise ValueError(f"request {req_id}: first position {start} outside its capacity {capacity}")
        name = segment_name(self.token, req_id, self.kind)
        self.reaper.created(name)  # a stub left by a failed reservation is unlinked like a segment
        try:
            seg = RowsSegment.create(name, start, capacity, self.num_layers, self.top_k, self.dtype)
        except OSError:
            self.lose(req_id)
            raise
        self._requests[req_id] = _RequestRows(seg, block_hashes=self._pending_hashes.pop(req_id, []))

    def lose(self, req_id: str) -> None:
        """The request runs without a segment (it could not be created, or was never opened):
        it is not retried every step, and the API server reports its routing missing."""
        self._lost.add(req_id)

    def resume(self, req_id: str) -> bool:
        """A request scheduled again after vLLM preempted it (and reported it finished):
        map its segment again, rows and first position as they were. False if it has none."""
        if req_id in self._requests:
            return True
        name = segment_name(self.token, req_id, self.kind)
        try:
            seg = RowsSegment.open(name)
        except FileNotFoundError:
            return False
        self.reaper.resumed(name)
        self._requests[req_id] = _RequestRows(seg, first_write=False,
                                              block_hashes=self._pending_hashes.pop(req_id, []))
        return True

    def add_block_hashes(self, req_id: str, block_hashes: Sequence[bytes]) -> None:
        """Append the request's next block hashes (the scheduler sends new ones)."""
        st = self._requests.get(req_id)
        (st.block_hashes if st is not None else self._pending_hashes.setdefault(req_id, [])).extend(block_hashes)

    def write(self, req_id: str, start: int, rows: np.ndarray) -> None:
        """Rows for positions ``[start, start + len(rows))`` of one request (overwrites)."""
        if req_id not in self._requests:
            raise KeyError(f"request {req_id} was never opened")
        errors = self.write_step([(req_id, start, rows.shape[0])], rows)
        if errors:
            raise ValueError(errors[0])

    def write_step(self, spans: Sequence[tuple[str, int, int]], rows: np.ndarray) -> list[str]:
        """One forward step's rows, packed request after request: ``spans`` lists
        ``(req_id, first position, row count)`` in that order. Requests that are not
        open are skipped; a request whose rows do not fit is skipped and reported in
        the returned list of errors, the others are written.

        The request's first write fills the positions before its start that a
        prefix-cache hit skipped, from the block store. This runs every step
        for every request, right after the forward has evicted the
        interpreter's working set from the caches; so it copies bytes into the
        mappings (two plain slice stores per request) rather than going
        through numpy indexing, which costs ~5x more there."""
        if rows.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"rows shape {rows.shape} does not match [n, {self.num_layers}, {self.top_k}]")
        if rows.dtype != self.dtype:
            raise ValueError(f"rows dtype {rows.dtype} is not the store's {self.dtype}")
        try:
            data = memoryview(rows).cast("B")
        except TypeError:  # not C-contiguous
            data = memoryview(np.ascontiguousarray(rows)).cast("B")
        rb = self.num_layers * self.top_k * self.dtype.itemsize
        bs = self.block_size
        requests = self._requests
        errors = []
        off = 0
        for req_id, start, n in spans:
            st = requests.get(req_id)
            if st is not None:
                seg = st.seg
                end = start + n
                if start < 0 or end > seg.capacity:
                    errors.append(f"request {req_id}: positions [{start}, {end}) outside its capacity {seg.capacity}")
                else:
                    if st.first_write:
                        st.first_write = False
                        if start > 0:
                            self._fill_from_blocks(st, start)
                    mm = seg.mm
                    at = seg.rows_at + start * rb
                    mm[at : at + n * rb] = data[off * rb : (off + n) * rb]
                    at = seg.flags_at + start
                    if n == 1:
                        mm[at] = 1
                    else:
                        mm[at : at + n] = b"\x01" * n
                    if end >= (st.published_blocks + 1) * bs:
                        self._publish(st)
            off += n
        return errors

    def _publish(self, st: _RequestRows) -> None:
        """Store every full block whose rows are all known under its hash (as bytes).

        Runs from the per-step write: the check and the copy are mmap byte
        operations, not numpy calls (see ``write_step``)."""
        bs = self.block_size
        seg = st.seg
        mm, fa, ra, rb = seg.mm, seg.flags_at, seg.rows_at, seg.row_bytes
        i = st.published_blocks
        while i < len(st.block_hashes):
            lo, hi = i * bs, (i + 1) * bs
            if hi > seg.capacity or mm.find(b"\x00", fa + lo, fa + hi) != -1:
                break
            h = st.block_hashes[i]
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                rows = self._blocks[h] = mm[ra + lo * rb : ra + hi * rb]
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
                if self.on_publish is not None:
                    self.on_publish(h, i, rows)
            i += 1
        st.published_blocks = i

    def _fill_from_blocks(self, st: _RequestRows, end: int) -> None:
        """Fill unwritten positions below `end` from blocks stored under the request's hashes
        (positions with no stored block stay unwritten: the API server reports them)."""
        self._take_loaded()
        bs = self.block_size
        seg = st.seg
        for blk in range(min(-(-end // bs), len(st.block_hashes))):
            block = self._blocks.get(st.block_hashes[blk])
            if block is None:
                continue
            self._blocks.move_to_end(st.block_hashes[blk])
            rows = np.frombuffer(block, self.dtype).reshape(bs, self.num_layers, self.top_k)
            lo, hi = blk * bs, min((blk + 1) * bs, end)
            need = seg.written[lo:hi] == 0
            seg.rows[lo:hi][need] = rows[: hi - lo][need]
            seg.written[lo:hi] = 1

    def add_block(self, block_hash: bytes, rows: np.ndarray) -> None:
        """Rows ``[block_size, L, K]`` of a block computed elsewhere (loaded from a shared pool).

        Safe from any thread (the pool's lookups run on their own): the block is queued and
        joins the store in the step thread, before the next request's first write."""
        if rows.shape != (self.block_size, self.num_layers, self.top_k) or rows.dtype != self.dtype:
            raise ValueError(f"block rows {rows.shape} {rows.dtype} do not match "
                             f"[{self.block_size}, {self.num_layers}, {self.top_k}] {self.dtype}")
        self._loaded.append((block_hash, np.ascontiguousarray(rows).tobytes()))

    def _take_loaded(self) -> None:
        while self._loaded:
            h, rows = self._loaded.popleft()
            self._blocks[h] = rows
            self._blocks.move_to_end(h)
            if len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def finish(self, req_id: str) -> None:
        """The request ended: publish its last blocks and let go of its segment
        (the API server unlinks it once read, the reaper if nobody does)."""
        self._pending_hashes.pop(req_id, None)
        st = self._requests.pop(req_id, None)
        if st is None:
            if req_id in self._lost:
                self._lost.discard(req_id)
                self.reaper.finished(segment_name(self.token, req_id, self.kind))
            return
        self._publish(st)
        st.seg.close()
        self.reaper.finished(st.seg.name)

    def reset(self) -> None:
        """Forget every block (after a prefix-cache reset or a weight update:
        new weights route differently, so old blocks must not be reused). Blocks loaded from a
        pool and not yet taken in are kept: the scheduler looks them up after asking for the
        reset, before the worker applies it, so they belong to the new generation."""
        self._blocks.clear()
        for st in self._requests.values():
            st.published_blocks = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def not_open(self, req_ids: Mapping[str, object]) -> set[str]:
        """Which requests (keys of req_ids) have no open segment and are not lost; runs every
        step, and in most steps every one is open: one subset test of the two key views."""
        if req_ids.keys() <= self._requests.keys():
            return set()
        return set(req_ids).difference(self._requests, self._lost)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)
