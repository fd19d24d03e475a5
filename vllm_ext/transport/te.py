"""The Mooncake Transfer Engine lane of the streaming transport: receivers pull, across hosts.

The sender registers a few slots of memory with a Mooncake ``TransferEngine`` (P2P
handshake: no master, no metadata server; TCP here, RDMA where the cluster has it)
and offers its address; each receiver reads every published piece straight out of the
sender's slot with ``transfer_sync_read`` into its own registered bounce buffer,
checks the piece's xxh3 (taken by the sender from the slot), and copies it into the
unit it belongs to. Two gloo groups pace it, so the bytes never cross gloo: on the
first the sender broadcasts each piece's descriptor (sequence, length, hash), on the
second every receiver acknowledges it (an all-reduce the sender waits on only before
reusing that slot), so up to ``slots`` pieces are in flight.

The engine is imported only when a sender offers this lane or a receiver takes it.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .format import WeightUpdateError
from .shm import digester, gather, pieces

__all__ = ["TeOffer", "TeSource", "TeSink", "sink_host", "te_problem"]

_MASK = 0x7FFFFFFFFFFFFFFF


def te_problem() -> str | None:
    """Why this process cannot use the TE lane, or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a missing wheel or one of its system libraries
        return f"Mooncake Transfer Engine unavailable: {type(exc).__name__}: {exc}"
    return None


def _engine(host: str):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise OSError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) failed")
    return te


def _register(te, buf: torch.Tensor) -> None:
    if te.register_memory(buf.data_ptr(), buf.numel()) != 0:
        raise OSError(f"Mooncake register_memory of {buf.numel()} bytes failed")


@dataclass(frozen=True)
class TeOffer:
    host: str
    port: int
    base: int
    slots: int
    slot_bytes: int

    def to_json(self) -> dict:
        return asdict(self)


class TeSource:
    """The sender's registered slots, kept across updates."""

    def __init__(self, slots: int = 4, slot_bytes: int = 4 << 20, host: str | None = None):
        self.host = host or "127.0.0.1"
        self.slots, self.slot_bytes = slots, slot_bytes
        self.te = _engine(self.host)
        self.buf = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        _register(self.te, self.buf)
        self.digest = digester()

    def offer(self) -> TeOffer:
        return TeOffer(self.host, int(self.te.get_rpc_port()), self.buf.data_ptr(), self.slots, self.slot_bytes)

    def writer(self, desc_pg, ack_pg) -> "TeWriter":
        return TeWriter(self, desc_pg, ack_pg)

    def close(self) -> None:
        if self.te is not None:
            self.te.unregister_memory(self.buf.data_ptr())
            self.te = None


class TeWriter:
    """Sender side of one update: units in, pieces published slot by slot."""

    def __init__(self, src: TeSource, desc_pg, ack_pg):
        self.src, self.desc_pg, self.ack_pg = src, desc_pg, ack_pg
        self.seq = 0
        self.acks: list = []  # per piece: (descriptor broadcast, acknowledgement all-reduce, their tensors)

    def put(self, parts: list[tuple[int, torch.Tensor]], size: int) -> None:
        src, j = self.src, 0
        for off in range(0, size, src.slot_bytes):
            n = min(src.slot_bytes, size - off)
            if self.seq >= src.slots:  # the slot's previous piece must have been read by everyone
                for w in self.acks[self.seq - src.slots][:2]:
                    w.wait()
            at = (self.seq % src.slots) * src.slot_bytes
            j = gather(parts, j, off, n, src.buf.data_ptr() + at)
            desc = torch.tensor([self.seq, n, src.digest(memoryview(src.buf[at:at + n].numpy())) & _MASK],
                                dtype=torch.int64)
            ack = torch.zeros(1, dtype=torch.int64)
            self.acks.append((self.desc_pg.broadcast(desc, 0), self.ack_pg.allreduce([ack]), desc, ack))
            self.seq += 1

    def finish(self) -> None:
        for d, a, _, _ in self.acks:
            d.wait()
            a.wait()
        self.acks = []


class TeSink:
    """A receiver's engine and bounce buffer, kept across updates."""

    def __init__(self, slot_bytes: int, host: str):
        self.te = _engine(host)
        self.bounce = torch.zeros(slot_bytes, dtype=torch.uint8)
        _register(self.te, self.bounce)

    def read(self, offer: TeOffer, sizes: Sequence[int], bufs: Sequence[torch.Tensor] | None, desc_pg, ack_pg,
             on_unit: Callable[[int], str | None] | None = None) -> str | None:
        """Every piece of one update into ``bufs`` (None: drain); why to refuse, else None."""
        digest = digester()
        target = f"{offer.host}:{offer.port}"
        refusal: str | None = None
        for seq, (u, off, n) in enumerate(pieces(sizes, offer.slot_bytes)):
            desc = torch.empty(3, dtype=torch.int64)
            desc_pg.broadcast(desc, 0).wait()
            if bufs is not None and refusal is None:
                got_seq, got_n, want = (int(x) for x in desc)
                remote = offer.base + (seq % offer.slots) * offer.slot_bytes
                if got_seq != seq or got_n != n:
                    refusal = f"te: piece {got_seq} ({got_n} bytes) where piece {seq} ({n} bytes) was due"
                elif self.te.transfer_sync_read(target, self.bounce.data_ptr(), remote, n) != 0:
                    raise WeightUpdateError(f"te: transfer_sync_read of piece {seq} from {target} failed")
                elif digest(memoryview(self.bounce[:n].numpy())) & _MASK != want:
                    refusal = f"te: checksum mismatch in piece {seq} (unit {u}, bytes {off}..{off + n})"
                else:
                    ctypes.memmove(bufs[u].data_ptr() + off, self.bounce.data_ptr(), n)
                    if on_unit is not None and off + n == sizes[u]:
                        refusal = on_unit(u)
            ack_pg.allreduce([torch.zeros(1, dtype=torch.int64)]).wait()  # the sender posted its half already
        return refusal

    def close(self) -> None:
        if self.te is not None:
            self.te.unregister_memory(self.bounce.data_ptr())
            self.te = None


def sink_host(offer: TeOffer) -> str:
    """The address this receiver's engine takes: loopback for a loopback sender, else this host's."""
    return "127.0.0.1" if offer.host.startswith("127.") else socket.gethostbyname(socket.gethostname())
