"""Same-host data lane of the streaming transport: a ring of buckets in /dev/shm.

Why: a same-host update over gloo's loopback TCP moved 1-3 GB/s, 8-16 % of a
memory copy on this machine. Here the sender copies each piece of the byte
stream into a slot of a small shared ring and the receivers copy it out, on
other cores, while the sender fills the next slot: two copies, pipelined, and
the ring small enough (8 x 1 MiB) to stay in the last-level cache, so each copy
touches main memory only on its far side.

What stays on torch.distributed (``stream.py``, ``channel.py``): the session
handshake, the manifest and each receiver's choice of lane (through the
sender's TCPStore), the trailer and the closing barrier (gloo), and failure
detection: each side keeps one gloo operation posted for the whole data phase
that only the other side completes (the receivers' trailer broadcast, the
sender's closing barrier), and polls it whenever the ring makes it wait; a peer
that dies closes its sockets and the operation fails at once. The per-slot
handshakes are counters in the segment header plus a futex, not gloo
collectives: a gloo round trip costs 0.3-0.75 ms here (measured), about the time
of copying ten 1 MiB slots. Plain aligned stores publish a slot only under
x86-64's total store order, so the lane is x86-64 Linux only; elsewhere every
receiver takes the network path.

Integrity: the sender hashes every slot right after filling it and the receiver
hashes its own copy right after copying it (xxh3-64, ``format.hasher``), both
while the bytes are still in the core's cache: the bytes a receiver applies
are the bytes the sender hashed, and a piece changed in shared memory (or read
from the wrong slot) is refused. The cost, measured: xxh3 on cached data runs
at ~57 GB/s against 14-17 GB/s for the copies, a fifth of each end's work, and
the lane runs 18-28 % faster with both hashes removed. It is kept: any check
that catches a single changed byte must read every byte at both ends, xxh3
already reads at cache speed, and hashing in smaller chunks to stay in L2
(tried: 256 KiB) costs more in calls than it saves.

Lifetime: the sender creates the segment once (pre-faulted, reused by every
update), holds an ``flock`` on it for its lifetime and unlinks it on
``close()``, on garbage collection and at exit; a receiver keeps its mapping
between updates and drops it when the sender changes or fails. A sender that
is killed leaves its segment unlocked: ``sweep()`` (run when a sender creates a
ring and when a receiver loses its sender) unlinks every unlocked
``moerl-weights-*`` segment.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import secrets
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .format import WeightUpdateError, hasher

__all__ = ["RingShape", "ShmOffer", "ShmRing", "RingWriter", "attach", "choose", "digester", "gather",
           "host_id", "pieces", "read_ring", "sweep"]

logger = logging.getLogger("vllm_ext.transport")

SHM_DIR = Path("/dev/shm")
PREFIX = "moerl-weights-"
_MAGIC = b"MOERLRNG"
_LINE = 64  # one header field per cache line: no false sharing between writers
_PAGE = 4096
_POLL_S = 0.05  # longest futex sleep between two looks at the watched gloo operation
_BUILD_S = 60.0  # a ring still under construction (hidden name) after this long was abandoned


@dataclass(frozen=True)
class RingShape:
    """Slots x slot_bytes: small enough to stay in cache, enough slots to absorb jitter."""

    slots: int = 8
    slot_bytes: int = 1 << 20


@dataclass(frozen=True)
class ShmOffer:
    """What a sender advertises in ``update_info['shm']``; a receiver uses the ring only
    if it runs on the same host, can open the segment, finds the same token in it,
    and hashes with the same algorithm."""

    name: str
    host: str
    token: str
    slots: int
    slot_bytes: int
    readers: int
    checksum: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "ShmOffer":
        return cls(**obj)


def host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes sharing one running kernel."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def unsupported_reason() -> str | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"shared-memory lane needs x86-64 Linux, this is {sys.platform}/{platform.machine()}"
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist"
    return None


# --------------------------------------------------------------------------- futex

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the word is shared between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_POLL = _Timespec(0, int(_POLL_S * 1e9))


def _futex_wait(addr: int, seen: int) -> None:
    """Sleep while the int32 at addr still equals seen (at most _POLL_S; spurious wakeups are fine)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(_POLL), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


# --------------------------------------------------------------------------- the segment


def _layout(shape: RingShape, readers: int) -> tuple[int, int]:
    """(header bytes, total bytes). Header lines: 0 magic/token/shape, 1 published
    count, 2 abort flag, then one consumed count per reader, then one descriptor
    (seq, nbytes, digest) per slot."""
    header = (3 + readers + shape.slots) * _LINE
    header = (header + _PAGE - 1) // _PAGE * _PAGE
    return header, header + shape.slots * shape.slot_bytes


class ShmRing:
    """A mapped ring segment (either end). Counters and descriptors are read and
    written through ctypes objects placed on the mapping (one aligned store each)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, shape: RingShape, readers: int, token: str, *, owner: bool):
        self.path, self.shape, self.readers, self.token, self.owner = path, shape, readers, token, owner
        self.header, self.size = _layout(shape, readers)
        self._fd, self._mm = fd, mm
        probe = ctypes.c_char.from_buffer(mm)
        self.base = ctypes.addressof(probe)
        del probe  # keep no buffer export: close() must be able to unmap
        self.view = memoryview(mm)
        self.published = ctypes.c_int32.from_address(self.base + _LINE)
        self.aborted = ctypes.c_int32.from_address(self.base + 2 * _LINE)
        self.consumed = [ctypes.c_int32.from_address(self.base + (3 + r) * _LINE) for r in range(readers)]
        d0 = self.base + (3 + readers) * _LINE
        self.desc = [(ctypes.c_int64.from_address(d0 + s * _LINE), ctypes.c_int64.from_address(d0 + s * _LINE + 8),
                       ctypes.c_uint64.from_address(d0 + s * _LINE + 16)) for s in range(shape.slots)]
        self._finalizer = weakref.finalize(self, _release, self.view, mm, fd, path if owner else None)

    # -- both ends

    @property
    def name(self) -> str:
        return self.path.name

    def slot_offset(self, seq: int) -> int:
        return self.header + (seq % self.shape.slots) * self.shape.slot_bytes

    def unlink(self) -> None:
        """Remove the segment's name now (sender), keeping the mapping: for a ring left to a
        lane still blocked on a lost receiver, which unmaps it when it ends."""
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap (and, for the sender, unlink). Drops the ctypes views first: they
        point into the mapping."""
        self.published = self.aborted = None
        self.consumed, self.desc = [], []
        self._finalizer()

    # -- sender

    @classmethod
    def create(cls, readers: int, shape: RingShape = RingShape()) -> "ShmRing":
        """A new segment, locked, sized, pre-faulted and stamped with a random token.

        Built under a hidden name and renamed when ready, so a reader never
        opens a half-built ring; the lock is taken before the rename so that
        ``sweep()`` never mistakes a live ring for a dead one."""
        if reason := unsupported_reason():
            raise OSError(errno.ENOTSUP, reason)
        if shape.slots < 2 or shape.slot_bytes <= 0 or shape.slot_bytes % _PAGE:
            raise ValueError(f"ring needs >= 2 slots of a positive multiple of {_PAGE} bytes, got {shape}")
        sweep()
        token = secrets.token_hex(8)
        final = SHM_DIR / f"{PREFIX}{os.getpid()}-{token}"
        building = SHM_DIR / f".{final.name}.init"
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            header, size = _layout(shape, readers)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            mm[:] = bytes(size)  # touch every page once: no page faults during updates
            mm[: len(_MAGIC) + 8] = _MAGIC + bytes.fromhex(token)
            os.rename(building, final)
        except BaseException:
            os.close(fd)
            building.unlink(missing_ok=True)
            raise
        return cls(final, fd, mm, shape, readers, token, owner=True)

    def offer(self) -> ShmOffer:
        return ShmOffer(name=self.name, host=host_id(), token=self.token, slots=self.shape.slots,
                        slot_bytes=self.shape.slot_bytes, readers=self.readers, checksum=hasher()[0])

    def reset(self) -> None:
        """Zero the counters before an update (readers look at them only once the
        update's handshake, which follows this, is done)."""
        self.published.value = 0
        self.aborted.value = 0
        for c in self.consumed:
            c.value = 0

    def writer(self, readers: Sequence[int], watch) -> "RingWriter":
        return RingWriter(self, list(readers), watch)


def attach(offer: ShmOffer) -> ShmRing:
    """Map a sender's ring (receiver side); OSError when it cannot be the advertised one."""
    path = SHM_DIR / offer.name
    if os.sep in offer.name or not offer.name.startswith(PREFIX):
        raise OSError(errno.EINVAL, f"not a moerl ring name: {offer.name!r}")
    shape = RingShape(offer.slots, offer.slot_bytes)
    _, size = _layout(shape, offer.readers)
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(errno.EINVAL, f"{path}: {os.fstat(fd).st_size} bytes, offer implies {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    ring = ShmRing(path, fd, mm, shape, offer.readers, offer.token, owner=False)
    if bytes(ring.view[: len(_MAGIC) + 8]) != _MAGIC + bytes.fromhex(offer.token):
        ring.close()
        raise OSError(errno.EINVAL, f"{path}: token differs from the offer (another segment of the same name)")
    return ring


def choose(offer: dict | None, reader: int) -> tuple[ShmRing | None, str]:
    """The receiver's lane: (ring, why) or (None, why not)."""
    if offer is None:
        return None, "the sender offers no shared memory (network path forced or unavailable there)"
    try:
        o = ShmOffer.from_json(offer)
    except TypeError as exc:
        return None, f"unreadable offer: {exc}"
    if reason := unsupported_reason():
        return None, reason
    if o.host != host_id():
        return None, f"sender on another host ({o.host})"
    if o.checksum != hasher()[0]:
        return None, f"sender hashes with {o.checksum}, this process with {hasher()[0]}"
    if not 0 <= reader < o.readers:
        return None, f"ring has {o.readers} reader slots, this is reader {reader}"
    try:
        return attach(o), f"same host, {SHM_DIR / o.name}"
    except OSError as exc:
        return None, f"cannot open {SHM_DIR / o.name}: {exc}"


def _release(view: memoryview, mm: mmap.mmap, fd: int, unlink: Path | None) -> None:
    view.release()
    mm.close()
    if unlink is not None:  # unlink before unlocking: sweep() never sees it unlocked
        unlink.unlink(missing_ok=True)
    os.close(fd)


def sweep() -> list[str]:
    """Unlink every ring whose sender is gone (its flock is free); returns their names.
    A ring under construction is not locked for its first instant: those are left
    alone until they are old enough to be abandoned."""
    removed = []
    now = time.time()
    building = [p for p in SHM_DIR.glob(f".{PREFIX}*.init") if _age(p, now) > _BUILD_S]
    for path in [*SHM_DIR.glob(f"{PREFIX}*"), *building]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its sender is alive
        else:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        finally:
            os.close(fd)
    if removed:
        logger.warning("moerl weights: removed %d shared-memory ring(s) left by dead senders: %s",
                       len(removed), ", ".join(removed))
    return removed


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


# --------------------------------------------------------------------------- the byte stream


def pieces(sizes: Sequence[int], slot_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(unit index, offset in the unit, length): the units cut into slot-sized pieces."""
    for u, size in enumerate(sizes):
        for off in range(0, size, slot_bytes):
            yield u, off, min(slot_bytes, size - off)


def digester() -> Callable[[memoryview], int]:
    """The transports' 64-bit hash (``format.hasher``) as a function of a buffer."""
    make = hasher()[1]

    def digest(view: memoryview) -> int:
        h = make()
        h.update(view)
        return int.from_bytes(h.digest(), "big")

    return digest


def gather(parts: list[tuple[int, torch.Tensor]], j: int, lo: int, n: int, dst: int) -> int:
    """Copy bytes [lo, lo + n) of a unit made of ``parts`` (offset in the unit, flat
    uint8 tensor; in offset order, gaps are padding) to address ``dst``, starting at
    part j; returns the first part that continues past lo + n."""
    hi = lo + n
    while j < len(parts):
        poff, t = parts[j]
        a, b = max(poff, lo), min(poff + t.numel(), hi)
        if a < b:
            ctypes.memmove(dst + a - lo, t.data_ptr() + a - poff, b - a)
        if poff + t.numel() > hi:
            break
        j += 1
    return j


Lagging = Callable[[], "tuple[ctypes.c_int32, int] | None"]


def _wait(lagging: Lagging, watch, what: str) -> None:
    """Sleep until ``lagging()`` returns None; otherwise it returns a counter that is
    behind and the value it was judged on, and the futex sleep ends as soon as that
    counter moves (no lost wakeup: the kernel compares with the judged value).
    Between sleeps, fail if the watched gloo operation finished: with an error
    (the peer died or timed out) or early (the peer gave up)."""
    while (behind := lagging()) is not None:
        if watch.is_completed():
            try:
                watch.wait()
            except Exception as exc:
                raise WeightUpdateError(f"stream (shm): lost the peer while waiting for {what}: {exc}") from exc
            if lagging() is None:  # it moved between the two looks, then the peer finished
                return
            raise WeightUpdateError(f"stream (shm): peer closed the update while waiting for {what}")
        word, seen = behind
        _futex_wait(ctypes.addressof(word), seen)


class RingWriter:
    """Sender side of one update: units in, pieces out through the ring.

    ``readers``: ring reader indices taking part (rank - 1 of the receivers that
    chose this lane). ``watch``: the sender's posted closing barrier."""

    def __init__(self, ring: ShmRing, readers: list[int], watch):
        self.ring, self.watch = ring, watch
        self.readers = [ring.consumed[r] for r in readers]
        self.seq = 0
        self.digest = digester()

    def _behind(self, need: int) -> tuple[ctypes.c_int32, int] | None:
        """A reader's counter that is below ``need``, with its value."""
        for c in self.readers:
            if (v := c.value) < need:
                return c, v
        return None

    def put(self, parts: list[tuple[int, torch.Tensor]], size: int) -> None:
        """One unit of ``size`` bytes: ``parts`` = (offset in the unit, flat uint8 CPU
        tensor), in offset order; the gaps between parts are padding (hashed as they are)."""
        ring, j = self.ring, 0
        for off in range(0, size, ring.shape.slot_bytes):
            n = min(ring.shape.slot_bytes, size - off)
            need = self.seq - ring.shape.slots + 1  # the slot's previous piece is consumed
            if self._behind(need) is not None:
                _wait(lambda: self._behind(need), self.watch, "a free slot")
            at = ring.slot_offset(self.seq)
            j = gather(parts, j, off, n, ring.base + at)
            self._publish(n, self.digest(ring.view[at:at + n]))  # while the slot is in this core's cache

    def _publish(self, n: int, digest: int) -> None:
        seq_, nbytes, dig = self.ring.desc[self.seq % self.ring.shape.slots]
        seq_.value, nbytes.value, dig.value = self.seq, n, digest
        self.seq += 1
        self.ring.published.value = self.seq  # after the descriptor and the bytes (x86-64 TSO)
        _futex_wake(ctypes.addressof(self.ring.published))

    def finish(self) -> None:
        """Wait until every reader has consumed every piece (the ring is reusable after)."""
        _wait(lambda: self._behind(self.seq), self.watch, "the readers to finish")

    def abort(self) -> None:
        self.ring.aborted.value = 1
        _futex_wake(ctypes.addressof(self.ring.published))


def read_ring(ring: ShmRing, reader: int, sizes: Sequence[int], bufs: Sequence[torch.Tensor] | None,
              watch, on_unit: Callable[[int], str | None] | None = None) -> str | None:
    """Receiver side of one update: copy every piece into ``bufs`` (one flat uint8
    buffer per unit) and verify it; ``bufs=None`` drains (acknowledges without
    copying). ``on_unit(u)`` runs once unit u is whole and every piece of it verified,
    and may refuse (same as a corrupted piece). Returns why the update must be refused (the first corrupted piece,
    after which it stops copying but keeps draining so the sender finishes; or
    the sender's abort), else None. Raises WeightUpdateError if the sender is lost."""
    consumed = ring.consumed[reader]
    dst_views = [memoryview(b.numpy()) for b in bufs] if bufs is not None else None
    digest = digester()
    corrupt: str | None = None
    for seq, (u, off, n) in enumerate(pieces(sizes, ring.shape.slot_bytes)):
        if ring.published.value <= seq:
            _wait(lambda: _unpublished(ring, seq), watch, "the sender")
            if ring.published.value <= seq:  # woken by the abort flag
                return "the sender aborted the update"
        if dst_views is not None and corrupt is None:
            got_seq, got_n, want = (f.value for f in ring.desc[seq % ring.shape.slots])
            ctypes.memmove(bufs[u].data_ptr() + off, ring.base + ring.slot_offset(seq), n)
            if got_seq != seq or got_n != n:
                corrupt = f"slot holds piece {got_seq} ({got_n} bytes), expected piece {seq} ({n} bytes)"
            elif digest(dst_views[u][off:off + n]) != want:  # the copy, not the slot: what is applied is checked
                corrupt = (f"checksum mismatch in piece {seq} (unit {u}, bytes {off}..{off + n}): "
                           "corrupted in shared memory")
            if corrupt is None and on_unit is not None and off + n == sizes[u]:
                corrupt = on_unit(u)
        consumed.value = seq + 1
        _futex_wake(ctypes.addressof(consumed))
    return corrupt


def _unpublished(ring: ShmRing, seq: int) -> tuple[ctypes.c_int32, int] | None:
    """The published counter and its value while piece seq is not out (and no abort)."""
    v = ring.published.value
    return (ring.published, v) if v <= seq and not ring.aborted.value else None
