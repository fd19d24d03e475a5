"""Where captured routing rows wait until a response takes them (numpy only).

Two structures, both plain and testable without vLLM:

* per request, rows indexed by token *position* (not appended): a chunked
  prefill writes successive ranges, and a preempted request that recomputes
  simply overwrites the same positions, so the record stays one row per
  position whatever the scheduler did;
* a bounded LRU of full KV blocks keyed by the scheduler's block hash. A
  prefix-cache hit skips the forward for the cached tokens, so the capture
  never sees them; their rows come from the block the earlier request
  published under the same hash (equal hash = equal tokens and prefix, so
  equal routing), exactly like vLLM's own store.

Emitting follows vLLM's routed-experts contract: rows for positions
``[emit_cursor, num_tokens - 1)`` (the last sampled token was never fed
forward), each row emitted once, the first emit starting at the requested
prompt position.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RoutingStore", "MissingRowsError"]


class MissingRowsError(RuntimeError):
    """Rows for some positions were neither captured nor in the block store."""


@dataclass
class _RequestRows:
    rows: np.ndarray  # [capacity, L, K]
    written: np.ndarray  # [capacity] bool
    emit_cursor: int | None = None
    published_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def ensure(self, n: int) -> None:
        cap = self.rows.shape[0]
        if n <= cap:
            return
        new_cap = max(n, 2 * cap, 64)
        rows = np.zeros((new_cap, *self.rows.shape[1:]), dtype=self.rows.dtype)
        rows[:cap] = self.rows
        written = np.zeros(new_cap, dtype=bool)
        written[:cap] = self.written
        self.rows, self.written = rows, written


class RoutingStore:
    """Per-request position-indexed rows plus an LRU of rows by block hash."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype | str, block_size: int,
                 max_blocks: int = 65536) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.top_k = top_k
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._requests: dict[str, _RequestRows] = {}
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()

    # -- capture side -----------------------------------------------------

    def _state(self, req_id: str) -> _RequestRows:
        st = self._requests.get(req_id)
        if st is None:
            st = _RequestRows(
                rows=np.zeros((0, self.num_layers, self.top_k), dtype=self.dtype),
                written=np.zeros(0, dtype=bool),
            )
            self._requests[req_id] = st
        return st

    def write(self, req_id: str, start: int, rows: np.ndarray) -> None:
        """Rows for positions ``[start, start + len(rows))`` (overwrites)."""
        if rows.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"rows shape {rows.shape} does not match [n, {self.num_layers}, {self.top_k}]")
        st = self._state(req_id)
        end = start + rows.shape[0]
        st.ensure(end)
        st.rows[start:end] = rows
        st.written[start:end] = True

    def open(self, req_id: str, emit_start: int) -> None:
        """Register a scheduled request; its first emit starts at emit_start."""
        st = self._state(req_id)
        if st.emit_cursor is None:
            st.emit_cursor = emit_start

    def add_block_hashes(self, req_id: str, block_hashes: Sequence[bytes]) -> None:
        """Append the request's next block hashes (the scheduler sends new ones)."""
        self._state(req_id).block_hashes.extend(block_hashes)

    def emit_cursor(self, req_id: str) -> int:
        st = self._requests.get(req_id)
        return 0 if st is None or st.emit_cursor is None else st.emit_cursor

    def publish(self, req_id: str) -> None:
        """Store every full block whose rows are all known under its hash."""
        st = self._requests.get(req_id)
        if st is None:
            return
        bs = self.block_size
        i = st.published_blocks
        while i < len(st.block_hashes):
            lo, hi = i * bs, (i + 1) * bs
            if hi > st.written.shape[0] or not st.written[lo:hi].all():
                break
            h = st.block_hashes[i]
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = st.rows[lo:hi].copy()
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
            i += 1
        st.published_blocks = i

    # -- emit side --------------------------------------------------------

    def fill_from_blocks(self, req_id: str, end: int) -> None:
        """Fill unwritten positions below ``end`` from the block store."""
        st = self._state(req_id)
        st.ensure(end)
        missing = np.flatnonzero(~st.written[:end])
        if missing.size == 0:
            return
        bs = self.block_size
        for blk in np.unique(missing // bs):
            blk = int(blk)
            if blk >= len(st.block_hashes):
                continue
            rows = self._blocks.get(st.block_hashes[blk])
            if rows is None:
                continue
            self._blocks.move_to_end(st.block_hashes[blk])
            lo, hi = blk * bs, min((blk + 1) * bs, end)
            need = ~st.written[lo:hi]
            st.rows[lo:hi][need] = rows[: hi - lo][need]
            st.written[lo:hi] = True

    def emit(self, req_id: str, end: int, first_start: int) -> np.ndarray | None:
        """Rows ``[emit_cursor, end)`` not yet emitted (first call starts at
        ``first_start``); raises MissingRowsError rather than emit a gap."""
        st = self._state(req_id)
        if st.emit_cursor is None:
            st.emit_cursor = first_start
        start = st.emit_cursor
        if end <= start:
            return None
        self.fill_from_blocks(req_id, end)
        written = st.written[start:end]
        if not written.all():
            bad = start + int(np.flatnonzero(~written)[0])
            raise MissingRowsError(f"request {req_id}: no routing rows for position {bad} (of [{start}, {end}))")
        st.emit_cursor = end
        return st.rows[start:end].copy()

    def finish(self, req_id: str) -> None:
        self.publish(req_id)
        self._requests.pop(req_id, None)

    def reset(self) -> None:
        """Forget every block (after a prefix-cache reset or a weight update:
        new weights route differently, so old blocks must not be reused)."""
        self._blocks.clear()
        for st in self._requests.values():
            st.published_blocks = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)
