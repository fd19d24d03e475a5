"""The streaming transport, both ends: ``StreamSender`` / ``StreamReceiver``.

The sender is rank 0 and hosts the rendezvous store, every receiver a rank >= 1.
The control plane: a handshake through the store (the manifest, each receiver's
data lane), then on gloo a trailer (byte count, xxh3 of the manifest, abort flag)
and a closing barrier. The bytes go in units: a tensor of at least
``bucket_bytes`` alone, smaller ones packed into buckets; both ends derive the
same unit plan from the manifest. Data lanes: receivers on the sender's host copy
the units out of a shared-memory ring (``shm.py``: per-slot checksums, 2-4x the
loopback-TCP rate), the others receive gloo broadcasts (``_NetLane``). The store
and the gloo groups are kept across updates (``channel.py``). A sender that dies
mid-transfer makes the receiver's collective fail (connection closed or
timeout): the receiver raises and drops what it had. Like the filesystem
transport (``wire.py``) it delivers an update whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Callable, Iterable, Iterator

import torch

from .channel import ReceiverChannel, SenderChannel
from .format import FORMAT, TensorMeta, WeightUpdateError, check_against, digest, dtype_name, dtype_of, hasher
from .shm import RingShape, ShmRing, choose, read_ring, sweep
from .te import TeOffer, TeSink, TeSource, sink_host, te_problem

__all__ = ["StreamSender", "StreamReceiver", "StagingCache", "UpdateRefused", "stream_receive", "unit_plan"]

logger = logging.getLogger("vllm_ext.transport")

_ALIGN = 64


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).reshape(-1)


def unit_plan(metas: list[TensorMeta], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Units of transfer: lists of (tensor index, byte offset in the unit).

    A tensor of at least bucket_bytes is a unit of its own; smaller ones are
    packed in order, each at a 64-byte aligned offset, while they fit."""
    units: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    off = 0
    for i, m in enumerate(metas):
        n = m.nbytes
        if n >= bucket_bytes:
            if cur:
                units.append(cur)
                cur, off = [], 0
            units.append([(i, 0)])
            continue
        start = (off + _ALIGN - 1) // _ALIGN * _ALIGN
        if cur and start + n > bucket_bytes:
            units.append(cur)
            cur, start = [], 0
        cur.append((i, start))
        off = start + n
    if cur:
        units.append(cur)
    return units


def _unit_bytes(metas: list[TensorMeta], unit: list[tuple[int, int]]) -> int:
    i, off = unit[-1]
    return off + metas[i].nbytes


def _bcast(pg, t: torch.Tensor) -> None:
    pg.broadcast(t, 0).wait()


_MASK = 0x7FFFFFFFFFFFFFFF


def unit_digest(parts: Iterable[torch.Tensor]) -> int:
    """The transports' hash over a unit's tensors' bytes in order (padding excluded), as a
    non-negative int64: both ends compute it, so any unit can be checked before it is used."""
    h = hasher()[1]()
    for t in parts:
        h.update(memoryview(_bytes_view(t).numpy()))
    return int(h.hexdigest(), 16) & _MASK


class UpdateRefused(WeightUpdateError):
    """A receiver refused the update after a clean close (mismatch, corruption): the
    sender's channel stays usable."""


LANE_NET, LANE_SHM, LANE_TE = 1, 2, 3
LANES = {LANE_NET: "net", LANE_SHM: "shm", LANE_TE: "te"}


def _trailer(total: int, manifest: bytes, aborted: bool) -> torch.Tensor:
    return torch.tensor([total, int(digest(manifest), 16) & _MASK, int(aborted)], dtype=torch.int64)


class _NetLane:
    """Units broadcast over gloo, one unit per process group at a time (the groups'
    TCP connections run in parallel); a unit of one tensor goes out without a copy,
    packed units through one reusable bucket per group."""

    def __init__(self, pgs: list, buckets: list[torch.Tensor | None]):
        self.pgs, self.buckets = pgs, buckets
        self.works: list[tuple] = []

    def put(self, parts: list[tuple[int, torch.Tensor]], size: int) -> None:
        k = len(self.works)
        if len(parts) == 1:
            b = parts[0][1]
        else:
            if self.buckets[k] is None or self.buckets[k].numel() < size:
                self.buckets[k] = torch.empty(size, dtype=torch.uint8)
            for off, src in parts:
                self.buckets[k][off:off + src.numel()].copy_(src)
            b = self.buckets[k][:size]
        self.works.append((self.pgs[k].broadcast(b, 0), b))
        if len(self.works) == len(self.pgs):
            self.finish()

    def finish(self) -> None:
        for w, _ in self.works:
            w.wait()
        self.works = []


class StreamSender:
    """Rank 0 of streaming updates: hosts the rendezvous store and sends.

    Usage: ``s = StreamSender(world_size, port=...)`` (store listening), make the
    receivers join (``/update_weights`` with ``s.update_info(rank, version)``),
    then ``s.send(metas, tensors, version)``; ``close()`` when done. Keep one
    sender for many updates: its gloo groups (``channel.py``) and its ring are
    built once and reused.

    Two data lanes, chosen by each receiver (see ``shm.py``): receivers on this
    host read a shared-memory ring (``shm``: its shape; None forces the network
    path for everyone), the others get gloo broadcasts over ``streams`` process
    groups. ``timeout_s`` bounds each gloo and store operation and, on the shm
    lane, the whole data phase; ``join_timeout_s`` (default ``timeout_s``) the
    wait for the receivers to join an update (``send``'s ``gone``)."""

    def __init__(self, world_size: int, *, addr: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 120.0, bucket_bytes: int = 64 << 20, streams: int = 2,
                 shm: RingShape | None = RingShape(), te: bool = False, join_timeout_s: float | None = None):
        self.addr, self.world_size, self.timeout_s, self.bucket_bytes = addr, world_size, timeout_s, bucket_bytes
        self.join_timeout_s = join_timeout_s
        self.channel = SenderChannel(addr, port, world_size, timeout_s)
        self.port = self.channel.port
        self.token = secrets.token_hex(8)  # receivers keep one channel per sender
        self.streams = max(1, int(streams))
        self._buckets: list[torch.Tensor | None] = [None] * self.streams
        self._sends = 0
        self.ring = None
        if shm is not None:
            try:
                self.ring = ShmRing.create(world_size - 1, shm)
            except OSError as exc:
                logger.warning("moerl weights: no shared-memory lane (%s); every receiver takes the network path", exc)
        self.lanes: dict[int, str] = {}  # receiver rank -> lane it chose, for the last update
        self.asks: dict[int, dict] = {}  # receiver rank -> what it asked for (channel.py), for the last update
        self.te = TeSource(host=addr) if te else None  # Mooncake TE slots (te.py), offered when shm is not taken

    def update_info(self, rank: int, version: int) -> dict:
        return {"transport": "stream", "version": int(version), "addr": self.addr, "port": self.port,
                "rank": rank, "world_size": self.world_size, "timeout_s": self.timeout_s,
                "session": self._session(version), "sender": self.token,
                "shm": self.ring.offer().to_json() if self.ring else None,
                "te": self.te.offer().to_json() if self.te else None}

    def _session(self, version: int) -> str:
        return f"{int(version)}-{self._sends}"

    def send(self, metas: list[TensorMeta], tensors: Iterable[torch.Tensor | tuple[str, torch.Tensor]],
             version: int, *, session: str | None = None, extra: dict | None = None,
             gone: Callable[[], str | None] | None = None) -> int:
        """Send one update; tensors must come in metas order (lazily is fine). ``session``
        names a pass of a multi-pass update (default: the update's own, from ``update_info``);
        ``extra`` rides in the manifest; ``gone()``, polled while the receivers join, says why
        one will not (``channel.ReceiverLost``). Raises ``UpdateRefused`` when a receiver
        refused the update at its close; any other failure drops the gloo groups (the next
        update rebuilds them everywhere)."""
        try:
            return self._send(metas, tensors, version, session or self._session(version), extra or {}, gone)
        except UpdateRefused:
            raise
        except BaseException:
            self.channel.drop()
            raise
        finally:
            if session is None:
                self._sends += 1

    def next_session(self) -> None:
        """Move on to the next update's session (after the passes of a multi-pass update)."""
        self._sends += 1

    def _send(self, metas: list[TensorMeta], tensors: Iterable, version: int, session: str, extra: dict,
              gone: Callable[[], str | None] | None) -> int:
        if self.ring is not None:
            self.ring.reset()
        manifest = json.dumps({**extra, "format": FORMAT, "version": int(version), "bucket_bytes": self.bucket_bytes,
                               "streams": self.streams, "tensors": [m.to_json() for m in metas]}).encode()
        votes = self.channel.open(session, manifest, gone, self.join_timeout_s)
        groups = self.channel.groups
        self.lanes = {r: LANES[v] for r, v in enumerate(votes) if r}
        self.asks = dict(enumerate(self.channel.asks))
        net = [r for r in range(1, self.world_size) if votes[r] == LANE_NET]
        readers = [r - 1 for r in range(1, self.world_size) if votes[r] == LANE_SHM]
        # posted now, completed by the receivers at their end: the ring's failure detector;
        # it sums the receivers' refusals
        refused = torch.zeros(1, dtype=torch.int64)
        watch = groups.done.allreduce([refused])
        ring = self.ring.writer(readers, watch) if readers else None
        net_lane = _NetLane(self.channel.net(net, self.streams), self._buckets) if net else None
        te_ranks = [r for r in range(1, self.world_size) if votes[r] == LANE_TE]
        te_lane = self.te.writer(*self.channel.net(te_ranks, 2, kind="te")) if te_ranks else None
        lanes = [lane for lane in (ring, net_lane, te_lane) if lane]
        units = unit_plan(metas, self.bucket_bytes)
        trailer = _trailer(sum(_unit_bytes(metas, u) for u in units), manifest, aborted=False)
        digests = torch.zeros(len(units), dtype=torch.int64)
        it: Iterator = iter(tensors)
        sent = None  # the trailer's and the digests' broadcasts, once posted
        try:
            for k, unit in enumerate(units):
                parts = [(off, _bytes_view(_next_tensor(it, metas[i]))) for i, off in unit]
                digests[k] = unit_digest(t for _, t in parts)
                for lane in lanes:
                    lane.put(parts, _unit_bytes(metas, unit))
            for lane in (net_lane, te_lane):
                if lane:
                    lane.finish()
            # every piece is out: ring readers may see the trailer while they copy the last ones
            sent = [groups.ctl.broadcast(trailer, 0), groups.ctl.broadcast(digests, 0)]
            if ring:
                ring.finish()
            for w in sent:
                w.wait()
        except BaseException:
            if ring:  # release the ring's readers: they close the update, then the watch completes
                ring.abort()
                with contextlib.suppress(Exception):
                    for w in sent or [groups.ctl.broadcast(_trailer(-1, manifest, aborted=True), 0),
                                      groups.ctl.broadcast(digests, 0)]:
                        w.wait()
                    watch.wait()
            raise
        watch.wait()
        self.channel.forget(session)
        if int(refused[0]):
            raise UpdateRefused(f"stream: {int(refused[0])} receiver(s) refused the update (see their errors)")
        return int(trailer[0])

    def close(self) -> None:
        self.channel = None
        self._buckets = [None] * self.streams
        if self.te is not None:
            self.te.close()
            self.te = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None


def _next_tensor(it: Iterator, meta: TensorMeta) -> torch.Tensor:
    try:
        item = next(it)
    except StopIteration:
        raise WeightUpdateError(f"sender ran out of tensors before {meta.name}") from None
    if isinstance(item, tuple):
        name, t = item
        if name != meta.name:
            raise WeightUpdateError(f"sender yielded {name} where the manifest has {meta.name}")
    else:
        t = item
    if tuple(t.shape) != meta.shape or dtype_name(t.dtype) != meta.dtype:
        raise WeightUpdateError(f"{meta.name}: tensor {dtype_name(t.dtype)}{list(t.shape)} differs from the manifest")
    return t


def _verdict(trailer: torch.Tensor, total: int, manifest: bytes, ring_refusal: str | None,
             mismatch: WeightUpdateError | None) -> WeightUpdateError | None:
    """Why a received update must be refused, or None."""
    if int(trailer[2]):
        return WeightUpdateError("stream: the sender aborted the update")
    if int(trailer[0]) != total or int(trailer[1]) != int(_trailer(0, manifest, False)[1]):
        return WeightUpdateError(f"stream: trailer mismatch (sent {int(trailer[0])} bytes, expected {total})")
    if ring_refusal is not None:
        return WeightUpdateError(f"stream (shm): {ring_refusal}")
    return mismatch


def _tensors(metas: list[TensorMeta], units: list[list[tuple[int, int]]], bufs: list[torch.Tensor]) -> list:
    """The tensors as views of the unit buffers, in manifest order."""
    out: list[torch.Tensor | None] = [None] * len(metas)
    for unit, buf in zip(units, bufs):
        for i, off in unit:
            m = metas[i]
            out[i] = buf[off:off + m.nbytes].view(dtype_of(m.dtype)).reshape(m.shape)
    return out


_UNCHOSEN = object()  # StreamReceiver has not chosen a lane for any offer yet


class StreamReceiver:
    """Receiver side of streaming updates, kept by a replica between updates: its
    receive buffers (``StagingCache``), its control channel to the last sender
    (gloo groups reused while both ends hold them) and the sender's mapped ring.

    The lane: the ring when ``shm.choose`` accepts the sender's offer (same host,
    the segment opens, same token and hash), else the network path; the choice
    and its reason are logged whenever they are made anew (new sender or offer)."""

    def __init__(self) -> None:
        self.staging = StagingCache()
        self.channel: ReceiverChannel | None = None
        self._sender: tuple | None = None
        self.ring: ShmRing | None = None
        self._offer: dict | None | object = _UNCHOSEN
        self.sink: TeSink | None = None

    def _lane(self, offer: dict | None, reader: int) -> ShmRing | None:
        if offer != self._offer:
            self._drop_ring()
            self.ring, why = choose(offer, reader)
            self._offer = offer
            logger.info("moerl weights: streamed updates from this sender take the %s lane (%s)",
                        "shm" if self.ring else "net", why)
        return self.ring

    def _drop_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.ring, self._offer = None, _UNCHOSEN

    def receive(
        self, *, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 120.0,
        session: str | None = None, sender: str | None = None, shm: dict | None = None,
        version: int | None = None, expected: dict[str, TensorMeta] | None = None,
        on_unit: Callable | None = None, check: Callable[[dict], str | None] | None = None,
        expect: list[int] | None = None, te: dict | None = None, ask: dict | None = None, **_ignored,
    ) -> tuple[int, list[tuple[str, torch.Tensor]]] | tuple[int, dict, list[int]]:
        """One update: (version, [(name, tensor)] in manifest order).

        The manifest is checked against ``expected`` before any weight bytes are
        accepted; a mismatch still drains the stream (so the sender finishes) and
        then raises, as does a corrupted piece on the ring. A failure in the middle
        of the protocol (sender lost, timeout) also drops the channel and the ring.

        Streaming mode (``on_unit`` given): nothing is kept beyond two unit buffers;
        each unit, once whole and hashed (and equal to ``expect[u]`` when given), is
        passed to ``on_unit(u, [(meta, tensor view)])``, which copies what it needs and
        returns None or why the update must be refused (later units are then drained).
        ``check(manifest)`` replaces the ``expected`` check. Returns (version, manifest,
        unit digests); the digests were compared with the sender's. ``ask`` reaches the
        sender in the handshake (``StreamSender.asks``)."""
        streaming = on_unit is not None
        port, rank, world_size = int(port), int(rank), int(world_size)
        ring = self._lane(shm, rank - 1)
        te_offer = TeOffer(**te) if te and ring is None and te_problem() is None else None
        key = (addr, port, rank, world_size, sender)
        if self._sender != key:
            self.channel, self._sender = None, None
            try:
                self.channel = ReceiverChannel(addr, port, rank, world_size, float(timeout_s))
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__  # c10d appends its C++ stack
                raise WeightUpdateError(f"stream: cannot reach the sender at {addr}:{port} (it stopped, or its host "
                                        f"is unreachable): {first}") from exc
            self._sender = key
        ch = self.channel
        closed = False
        try:
            votes, manifest_bytes = ch.open(session or str(version),
                                            LANE_SHM if ring else LANE_TE if te_offer else LANE_NET, ask)
            manifest = json.loads(manifest_bytes)
            if manifest.get("format") != FORMAT:
                raise WeightUpdateError(f"stream: unexpected manifest format {manifest.get('format')!r}")
            metas = [TensorMeta.from_json(m) for m in manifest["tensors"]]
            mismatch: WeightUpdateError | None = None
            try:
                if streaming:
                    if (why := check(manifest) if check else None) is not None:
                        raise WeightUpdateError(why)
                else:
                    check_against(metas, expected)
                if version is not None and int(manifest["version"]) != int(version):
                    raise WeightUpdateError(f"stream: sender sends version {manifest['version']}, "
                                            f"update asked for {version}")
            except WeightUpdateError as exc:
                mismatch = exc
            units = unit_plan(metas, int(manifest["bucket_bytes"]))
            sizes = [_unit_bytes(metas, u) for u in units]
            trailer = torch.empty(3, dtype=torch.int64)
            sent_digests = torch.empty(len(units), dtype=torch.int64)
            got_digests: list[int] = []
            refusal = None
            use = streaming and mismatch is None

            def unit_done(u: int, buf: torch.Tensor) -> str | None:
                """Hash a whole unit; in streaming mode hand it on."""
                views = [(metas[i], buf[off:off + metas[i].nbytes].view(dtype_of(metas[i].dtype))
                          .reshape(metas[i].shape)) for i, off in units[u]]
                got_digests.append(unit_digest(t for _, t in views))
                if expect is not None and (u >= len(expect) or got_digests[-1] != expect[u]):
                    return f"unit {u} differs from the one verified before (sender changed or corrupted it)"
                return on_unit(u, views)

            ways = 2 if streaming else 1
            if ring is not None:
                watch = ch.groups.ctl.broadcast(trailer, 0)  # completes at the sender's end, fails if it dies
                bufs = None if mismatch is not None else (
                    self.staging.buffers(sizes, scratch=True, ways=ways) if streaming else self.staging.buffers(sizes))
                refusal = read_ring(ring, rank - 1, sizes, bufs, watch,
                                    on_unit=(lambda u: unit_done(u, bufs[u])) if use else None)
                watch.wait()
            elif te_offer is not None:
                if self.sink is None or self.sink.bounce.numel() < te_offer.slot_bytes:
                    self.sink = TeSink(te_offer.slot_bytes, sink_host(te_offer))
                desc_pg, ack_pg = ch.net([r for r in range(1, world_size) if votes[r] == LANE_TE], 2, kind="te")
                bufs = None if mismatch is not None else self.staging.buffers(sizes, scratch=streaming, ways=ways)
                refusal = self.sink.read(te_offer, sizes, bufs, desc_pg, ack_pg,
                                         on_unit=(lambda u: unit_done(u, bufs[u])) if use else None)
                _bcast(ch.groups.ctl, trailer)
            else:
                pgs = ch.net([r for r in range(1, world_size) if votes[r] == LANE_NET], int(manifest["streams"]))
                bufs = self.staging.buffers(sizes, scratch=mismatch is not None or streaming,
                                            ways=max(len(pgs), ways) if streaming else len(pgs))
                for w0 in range(0, len(units), len(pgs)):
                    works = [pg.broadcast(bufs[w0 + k], 0) for k, pg in enumerate(pgs) if w0 + k < len(units)]
                    for w in works:
                        w.wait()
                    for u in range(w0, min(w0 + len(pgs), len(units))):
                        if use and refusal is None:
                            refusal = unit_done(u, bufs[u])
                _bcast(ch.groups.ctl, trailer)
            _bcast(ch.groups.ctl, sent_digests)
            error = _verdict(trailer, sum(sizes), manifest_bytes, refusal, mismatch)
            if error is None and use and got_digests != sent_digests.tolist():
                error = WeightUpdateError("stream: unit checksum mismatch (corrupted in transit)")
            flag = torch.tensor([int(error is not None)], dtype=torch.int64)
            done = ch.groups.done.allreduce([flag])  # completes the sender's watch with this verdict
            items = None if error or streaming else [(m.name, t) for m, t in zip(metas, _tensors(metas, units, bufs))]
            done.wait()
            closed = True
            if error:
                raise error
            if streaming:
                return int(manifest["version"]), manifest, got_digests
            return int(manifest["version"]), items
        except Exception as exc:
            if not closed:  # the protocol broke: start afresh with this sender next time
                self.channel, self._sender = None, None
                if ring is not None:
                    self._drop_ring()
                    sweep()  # a lost sender cannot unlink its ring
            if isinstance(exc, WeightUpdateError):
                raise
            raise WeightUpdateError(f"stream: transfer from {addr}:{port} failed: {type(exc).__name__}: {exc}") \
                from exc

    def close(self) -> None:
        self.staging.clear()
        self.channel, self._sender = None, None
        self._drop_ring()
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def stream_receive(**update_info) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """One update with a fresh ``StreamReceiver`` (``update_info`` plus ``version``/``expected``)."""
    receiver = StreamReceiver()
    try:
        return receiver.receive(**update_info)
    finally:
        receiver.close()


class StagingCache:
    """Receive buffers kept between streaming updates.

    Fresh memory costs page faults on first touch (on this machine a copy into
    fresh memory runs at a quarter of a copy into touched memory), so a
    receiver that keeps its buffers receives the next update of the same layout
    at full speed. Holds one update's bytes; ``clear()`` releases them."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    def buffers(self, sizes: list[int], *, scratch: bool = False, ways: int = 1) -> list[torch.Tensor]:
        if scratch:  # drain without keeping: `ways` rotating scratch buffers
            big = [torch.empty(max(sizes, default=0), dtype=torch.uint8) for _ in range(ways)]
            return [big[i % ways][:n] for i, n in enumerate(sizes)]
        if [b.numel() for b in self._bufs] != sizes:
            self._bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return list(self._bufs)

    def clear(self) -> None:
        self._bufs = []
