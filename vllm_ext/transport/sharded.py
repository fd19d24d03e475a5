"""The sharded transport: every trainer rank streams its own pieces to every replica worker.

A resharding plan (``plan.py``) says which trainer rank sends which box of which
tensor to which replica worker (a vLLM TP rank). Each trainer rank keeps one
``StreamSender`` per receiver worker (its own store, gloo groups and shared-memory
ring: ``stream.py``), and all ranks and all workers run at once, so the bytes move
over as many lanes in parallel as there are (rank, worker) pairs, and no rank ever
holds more than the piece it is sending.

An update is two passes over the same pieces, both bounded by two units per lane
on the receiver:

1. **verify**: the worker receives every unit, hashes it, checks the hashes
   against the sender's and the pieces against its own layout (every box of every
   tensor it loads covered exactly once, nothing else), and keeps nothing. A
   refusal ends the update for that sender at its close; nothing was applied.
2. **apply**: the same pieces again, each unit checked against its hash from
   pass 1 before a byte of it is used, assembled into this worker's tensors and
   handed to vLLM's layerwise reload as each tensor completes.

A worker whose whole update fits in its assembly budget (``one_pass``: a small model,
or a model spread over many workers) asks its senders in the handshake for pass 1
only: it assembles each piece as it comes, checks everything at the pass's close as
above, and only then applies; the same guarantees for half the sending, reading and
hashing.

So a sender killed, a corrupted unit or a mismatched shape in pass 1 leaves the
old weights serving untouched, without a copy of them; the cost is moving the
bytes twice. A failure during pass 2 (the sender dying between its passes) leaves
a partly applied model: the update fails loudly and the next one restores it.

A lost receiver costs its sender only that receiver: every worker has lanes of its
own, so the others finish on the new version. A receiver that dies mid-pass fails
its lane at once (its sockets close); one that never joins (its replica died
before, or refused the update request) is reported by ``send``'s ``gone``, which
whoever drives the replicas answers, instead of after the store's timeout; one that
hangs is bounded by ``timeout_s`` per operation.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .format import ReceiverLost, TensorMeta, WeightUpdateError, dtype_of
from .plan import Box, Piece, box_numel, check_cover, intersect
from .shm import RingShape
from .stream import StreamReceiver, StreamSender

__all__ = ["ShardedSender", "ShardedReceiver", "Verified", "VERIFY", "APPLY", "one_pass"]

logger = logging.getLogger("vllm_ext.transport")

VERIFY, APPLY = "verify", "apply"
LOST_GRACE_S = 2.0  # a lost receiver's lane may end by itself (its peer's sockets closed) this long
_POLL_S = 0.02


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _manifest_extra(pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], rank: int) -> dict:
    """Boxes, full shapes and each tensor's position in the plan's order (``shapes``' order,
    the same on every rank: the receiver uses it to keep its lanes from blocking each other)."""
    pos = {n: i for i, n in enumerate(shapes)}
    return {"sharded": {"sender": rank, "boxes": [[list(b) for b in p.box] for p in pieces],
                        "shapes": {p.name: list(shapes[p.name]) for p in pieces},
                        "order": {p.name: pos[p.name] for p in pieces}}}


class _SharedReads:
    """``read(piece)`` once for all receivers that need the same box (replicas of one layout),
    within ``budget`` bytes: the lanes run side by side, so a piece one lane reads is soon taken
    by the others and the cache holds only their lag; past the budget a lane reads for itself.
    Reading is the trainer's copy and cast of its shard; per extra replica it was about a third
    of a small update's send time."""

    def __init__(self, read: Callable[[Piece], torch.Tensor], per: Sequence[Sequence[Piece]], budget: int):
        self.read, self.budget, self.held = read, budget, 0
        self.wanted = Counter((p.name, p.box) for mine in per for p in mine)
        self.cache: dict[tuple, tuple[torch.Tensor, int]] = {}
        self.lock = threading.Lock()

    def __call__(self, p: Piece, phase: str) -> torch.Tensor:
        key = (phase, p.name, p.box)
        with self.lock:
            if (hit := self.cache.pop(key, None)) is not None:
                t, left = hit
                if left > 1:
                    self.cache[key] = (t, left - 1)
                else:
                    self.held -= t.nbytes
                return t
        t = self.read(p)
        with self.lock:
            others = self.wanted[(p.name, p.box)] - 1
            if others and self.held + t.nbytes <= self.budget:
                self.cache[key] = (t, others)
                self.held += t.nbytes
        return t


class ShardedSender:
    """One trainer rank's end: a ``StreamSender`` per receiver worker, kept across updates.

    ``update_infos(version)`` gives what each worker needs to join (collected from all
    ranks by whoever drives the replicas' HTTP protocol); ``send`` then runs both passes
    to every worker at once. ``shm=None`` forces the network lane (gloo), or with ``te``
    the Mooncake Transfer Engine lane (``te.py``). ``names``: how errors call each
    receiver (e.g. its replica and TP rank); ``join_timeout_s``: the longest wait for a
    receiver to join a pass (default ``timeout_s``)."""

    def __init__(self, rank: int, receivers: int, *, addr: str = "127.0.0.1", timeout_s: float = 120.0,
                 bucket_bytes: int = 16 << 20, streams: int = 1, shm: RingShape | None = RingShape(),
                 te: bool = False, names: Sequence[str] | None = None, join_timeout_s: float | None = None):
        self.rank = rank
        self.bucket_bytes = bucket_bytes
        self._new_sender = lambda: StreamSender(2, addr=addr, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                                                streams=streams, shm=shm, te=te, join_timeout_s=join_timeout_s)
        self.senders = [self._new_sender() for _ in range(receivers)]
        self.names = list(names) if names is not None else [f"receiver {r}" for r in range(receivers)]
        self.lanes: dict[int, str] = {}

    def update_infos(self, version: int) -> list[dict]:
        return [s.update_info(1, version) for s in self.senders]

    def send(self, pieces: Sequence[Piece], read: Callable[[Piece], torch.Tensor], dtypes: Mapping[str, str],
             shapes: Mapping[str, Sequence[int]], version: int,
             gone: Callable[[int], str | None] | None = None) -> int:
        """Both passes of one update to every receiver worker at once; bytes sent per pass.

        ``pieces``: this rank's pieces (``Piece.sender == rank``), in plan order, which
        is ``shapes``' order;
        ``read(piece)`` its bytes as a CPU tensor of ``dtypes[name]``;
        ``gone(receiver)``: why that receiver is lost (its replica died, its update request
        failed), or None; polled throughout. A lost receiver's lane that has not ended
        ``LOST_GRACE_S`` later (blocked in a gloo or store operation with a dead or silent
        peer) is dropped, and the receiver gets a fresh ``StreamSender`` for the next update.
        Then one ``WeightUpdateError`` names each receiver that failed and its pass. A
        receiver that asks for one pass (its whole update fits its budget) gets no second.
        Returns the bytes sent to all receivers in one pass."""
        per = [[p for p in pieces if p.receiver == r] for r in range(len(self.senders))]
        errors: dict[int, tuple[str, BaseException]] = {}
        sent = [0] * len(self.senders)
        phases = [VERIFY] * len(self.senders)
        dropped: set[int] = set()
        lock = threading.Lock()
        shared = _SharedReads(read, per, 2 * self.bucket_bytes)

        def run(r: int, s: StreamSender) -> None:
            mine = per[r]
            metas = [TensorMeta(p.name, dtypes[p.name], _shape(p.box)) for p in mine]
            extra = _manifest_extra(mine, shapes, self.rank)
            base = s.update_info(1, version)["session"]
            try:
                for phase in (VERIFY, APPLY):
                    phases[r] = phase
                    sent[r] = s.send(metas, (shared(p, phase) for p in mine), version, session=f"{base}/{phase}",
                                     extra=extra, gone=None if gone is None else lambda: gone(r))
                    if s.asks.get(1, {}).get("passes") == 1:  # it kept the first pass (ShardedReceiver)
                        break
            except BaseException as exc:  # noqa: BLE001 - reported below, per receiver
                with lock:
                    errors.setdefault(r, (phases[r], exc))
            s.next_session()
            with lock:
                if r in dropped:
                    s.close()
                else:
                    self.lanes[r] = s.lanes.get(1, "?")

        threads = [threading.Thread(target=run, args=(r, s), daemon=True) for r, s in enumerate(self.senders)]
        for t in threads:
            t.start()
        lost: dict[int, tuple[float, str]] = {}
        while running := [r for r, t in enumerate(threads) if t.is_alive() and r not in dropped]:
            if gone is None:
                threads[running[0]].join()
                continue
            for r in running:
                if r not in lost and (why := gone(r)):
                    lost[r] = (time.monotonic(), why)
                elif r in lost and time.monotonic() - lost[r][0] > LOST_GRACE_S:
                    self._drop(r, threads[r], dropped, lock, errors, (phases[r], ReceiverLost(
                        f"{lost[r][1]}; its lane was still blocked {LOST_GRACE_S:.0f} s later: dropped")))
            time.sleep(_POLL_S)
        if errors:
            raise WeightUpdateError(f"v{version} from trainer rank {self.rank}: " + "; ".join(
                f"{self.names[r]} failed in the {phase} pass: {type(e).__name__}: {e}"
                for r, (phase, e) in sorted(errors.items())))
        return sum(sent)

    def _drop(self, r: int, thread: threading.Thread, dropped: set[int], lock: threading.Lock,
              errors: dict, error: tuple[str, BaseException]) -> None:
        """Leave lane r's thread behind with its sender (closed when its operation times out),
        the sender's ring already unlinked."""
        with lock:
            if thread.is_alive():
                dropped.add(r)
                errors.setdefault(r, error)
                if self.senders[r].ring is not None:
                    self.senders[r].ring.unlink()
                self.senders[r] = self._new_sender()

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.senders = []


@dataclass
class _Pending:
    buf: torch.Tensor
    left: int


class _Assembler:
    """Pieces in, whole tensors (this worker's box of each, in a full-shape tensor as
    vLLM's weight loaders expect) out, as each completes; ``budget`` bytes of tensors
    in progress at most: a lane that runs ahead waits, except for a tensor earlier in
    the plan's order (``order``) than every one in progress, since every lane sends in
    that order and the earliest unfinished tensor must always be able to finish.
    ``out``: how many finished tensors may wait for the loader (0: any number)."""

    def __init__(self, needs: Mapping[str, Box], dtypes: Mapping[str, str], order: Mapping[str, int],
                 budget: int, out: int = 2):
        self.needs, self.dtypes, self.order, self.budget = needs, dtypes, order, budget
        self.pending: dict[str, _Pending] = {}
        self.held = 0
        self.received = 0
        self.failed = False
        self.cond = threading.Condition()
        self.out: queue.Queue = queue.Queue(maxsize=out)

    def add(self, name: str, box: Box, shape: Sequence[int], t: torch.Tensor) -> str | None:
        """Copy one piece in; why not, once another lane failed."""
        with self.cond:
            entry = self.pending.get(name)
            if entry is None:
                dtype = dtype_of(self.dtypes[name])
                nbytes = box_numel(tuple((0, s) for s in shape)) * dtype.itemsize
                self.cond.wait_for(lambda: self.failed or self.held + nbytes <= self.budget or name in self.pending
                                   or all(self.order[name] < self.order[k] for k in self.pending))
                if self.failed:
                    return "another lane of this update failed"
                entry = self.pending.get(name)
                if entry is None:
                    entry = self.pending[name] = _Pending(torch.empty(tuple(shape), dtype=dtype),
                                                         box_numel(self.needs[name]))
                    self.held += nbytes
        entry.buf[tuple(slice(a, b) for a, b in box)].copy_(t)
        with self.cond:
            entry.left -= box_numel(box)
            self.received += t.numel() * t.element_size()
            done = entry.left == 0
            if done:
                del self.pending[name]
        if done:
            self.out.put((name, entry.buf))  # the loader owns it now; released below once consumed
        return None

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def consumed(self, t: torch.Tensor) -> None:
        with self.cond:
            self.held -= t.numel() * t.element_size()
            self.cond.notify_all()


def _feed(asm: _Assembler, manifests: Mapping[int, dict], i: int) -> Callable[[int, list], str | None]:
    """``on_unit`` for sender i's units: each piece into its tensor, where sender i's manifest
    (checked, and in ``manifests``, before its first unit arrives) says."""
    plan: list = []

    def on_unit(u: int, views) -> str | None:
        if not plan:
            man = manifests[i]
            metas = [TensorMeta.from_json(m) for m in man["tensors"]]
            plan.extend([[tuple(tuple(b) for b in box) for box in man["sharded"]["boxes"]], man["sharded"]["shapes"],
                         metas, _unit_index(metas, man)])
        boxes, shapes, metas, index = plan
        for k, (_, t) in zip(index[u], views):
            if why := asm.add(metas[k].name, boxes[k], shapes[metas[k].name], t):
                return why
        return None

    return on_unit


def one_pass(needs: Mapping[str, Box], expected: Mapping[str, TensorMeta] | None, budget: int) -> bool:
    """Whether a worker's whole update, as the full-shape tensors it assembles, fits in
    ``budget``: then it keeps what the first pass brings (verified at its close, applied
    after) and asks for no second one, which would move, read and hash every byte again."""
    if not expected or any(n not in expected for n in needs):
        return False
    return sum(math.prod(expected[n].shape) * dtype_of(expected[n].dtype).itemsize for n in needs) <= budget


@dataclass
class Verified:
    """One worker's update after its verify pass (``ShardedReceiver.verify``), for ``apply``."""

    infos: list[dict]
    needs: Mapping[str, Box]
    version: int
    budget: int
    manifests: dict[int, dict]
    digests: dict[int, list[int]]  # per sender whose pass closed cleanly: its units' hashes
    dtypes: dict[str, str]
    order: dict[str, int]
    kept: _Assembler | None  # one pass: the tensors it brought
    failure: str  # why this worker refuses the update ("" if it does not)
    seconds: float


class ShardedReceiver:
    """A replica worker's end, kept between updates: one ``StreamReceiver`` per trainer rank."""

    def __init__(self) -> None:
        self.receivers: dict[int, StreamReceiver] = {}
        self.last: dict = {}

    def _receiver(self, i: int) -> StreamReceiver:
        return self.receivers.setdefault(i, StreamReceiver())

    def receive(self, infos: Sequence[dict], needs: Mapping[str, Box], expected: Mapping[str, TensorMeta] | None,
                apply: Callable[[Iterator[tuple[str, torch.Tensor]]], None], *, version: int,
                budget: int = 32 << 20, agree: Callable[[bool], bool] = lambda ok: ok) -> int:
        """``verify`` then ``apply``: one whole update, here and now."""
        return self.apply(self.verify(infos, needs, expected, version=version, budget=budget), apply, agree=agree)

    def verify(self, infos: Sequence[dict], needs: Mapping[str, Box], expected: Mapping[str, TensorMeta] | None, *,
               version: int, budget: int = 32 << 20) -> Verified:
        """Pass 1 of one update from every trainer rank (``infos``: one ``update_info`` each);
        ``needs``: name -> the box this worker loads. It touches nothing the model serves from,
        so the replica may go on serving meanwhile (``vllm_ext.weights.engine`` runs it in the background).
        ``budget``: the bytes of tensors this worker holds while assembling them; when its whole
        update fits (``one_pass``), it keeps this pass instead of asking for a second. A refusal
        is recorded in the result, for ``apply`` to report (the senders still wait for it)."""
        manifests: dict[int, dict] = {}
        digests: dict[int, list[int]] = {}
        errors: dict[int, str] = {}
        one = one_pass(needs, expected, budget)
        dtypes = {m.name: m.dtype for m in (expected or {}).values()}
        order: dict[str, int] = {}
        lock = threading.Lock()
        # one pass: every tensor assembled during it, no waiting (it all fits), applied after it
        asm = _Assembler(needs, dtypes, order, budget, out=0) if one else None

        def check(i: int, manifest: dict) -> str | None:
            sh = manifest.get("sharded")
            if sh is None:
                return "not a sharded update"
            metas = [TensorMeta.from_json(m) for m in manifest["tensors"]]
            for m, box in zip(metas, sh["boxes"]):
                box = tuple(tuple(b) for b in box)
                if m.name not in needs:
                    return f"{m.name}: not a tensor of the served model"
                want = expected.get(m.name) if expected else None
                if want is not None and tuple(sh["shapes"][m.name]) != want.shape:
                    return (f"weight update does not match the served model: 1 mismatched: {m.name}: update "
                            f"{sh['shapes'][m.name]}, model {list(want.shape)}")
                if want is not None and not (dtype_of(m.dtype).is_floating_point
                                             and dtype_of(want.dtype).is_floating_point) and m.dtype != want.dtype:
                    return f"{m.name}: update dtype {m.dtype}, model {want.dtype}"
                if _shape(box) != m.shape or intersect(box, needs[m.name]) != box:
                    return f"{m.name}: piece {box} is not inside this worker's box {list(needs[m.name])}"
            with lock:
                for m in metas:
                    dtypes.setdefault(m.name, m.dtype)
                order.update(sh["order"])
            manifests[i] = manifest
            return None

        def verify(i: int, info: dict) -> None:
            try:
                _, _, got = self._receiver(i).receive(**dict(info, session=f"{info['session']}/{VERIFY}",
                                                             version=version),
                                                      on_unit=_feed(asm, manifests, i) if one else lambda u, v: None,
                                                      check=lambda m: check(i, m), ask={"passes": 1} if one else None)
                digests[i] = got
            except Exception as exc:  # noqa: BLE001 - reported as the update's error
                errors[i] = str(exc)

        t0 = time.perf_counter()
        _parallel(verify, infos)
        failure = "; ".join(f"from rank {i}: {e}" for i, e in sorted(errors.items()))
        if not failure:
            pieces = [Piece(m[0], tuple(tuple(b) for b in box), i, 0)
                      for i, man in manifests.items() for m, box in zip(man["tensors"], man["sharded"]["boxes"])]
            failure = check_cover(pieces, needs)
            if failure:
                failure = f"the senders' pieces do not make up this worker's weights: {failure}"
        return Verified(list(infos), needs, version, budget, manifests, digests, dtypes, order, asm, failure,
                        time.perf_counter() - t0)

    def apply(self, v: Verified, apply: Callable[[Iterator[tuple[str, torch.Tensor]]], None], *,
              agree: Callable[[bool], bool] = lambda ok: ok) -> int:
        """The rest of the update ``v`` verified: ``agree(ok)`` tells the replica's other workers
        whether this one verified everything and returns whether all did (no worker of a replica
        applies unless every one can: the swap is all or nothing per replica); then ``apply``
        consumes the (name, tensor) iterator (vLLM's ``load_weights``): the tensors kept from
        pass 1, or pass 2 assembled as it streams in. Returns the bytes received per pass."""
        failure = v.failure
        if not agree(not failure) and not failure:
            failure = "another worker of this replica refused the update"
        t1 = time.perf_counter()
        if v.kept is not None:
            if failure:
                raise WeightUpdateError(failure)
            v.kept.out.put(None)
            apply(iter(v.kept.out.get_nowait, None))
            self.last = {"bytes": v.kept.received, "senders": len(v.infos), "passes": 1, "verify_s": v.seconds,
                         "apply_s": time.perf_counter() - t1}
            return v.kept.received
        asm = _Assembler(v.needs, v.dtypes, v.order, v.budget)
        errors: dict[int, str] = {}

        def second(i: int, info: dict) -> None:
            """Pass 2 from sender i: drained when the update is already refused."""
            feed = _feed(asm, v.manifests, i)

            def on_unit(u: int, views) -> str | None:
                return "draining: the update was refused in its verify pass" if failure else feed(u, views)

            try:
                self._receiver(i).receive(**dict(info, session=f"{info['session']}/{APPLY}", version=v.version),
                                          on_unit=on_unit, expect=v.digests[i], check=lambda m: None)
            except Exception as exc:  # noqa: BLE001
                asm.fail()
                if not failure:
                    errors[i] = str(exc)

        if failure:  # the senders whose verify pass closed cleanly still send pass 2: drain it
            _parallel(second, {i: v.infos[i] for i in v.digests})
            raise WeightUpdateError(failure)
        feeder = threading.Thread(target=lambda: (_parallel(second, dict(enumerate(v.infos))), asm.out.put(None)),
                                  daemon=True)
        feeder.start()

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            while (item := asm.out.get()) is not None:
                yield item
                asm.consumed(item[1])

        items = stream()
        try:
            apply(items)
        finally:
            for _ in items:  # let the feeder finish even if apply stopped early
                pass
            feeder.join()
        if errors:
            raise WeightUpdateError("applying pass failed, the weights are partly updated (the next update "
                                    "restores them): " + "; ".join(f"from rank {i}: {e}" for i, e in errors.items()))
        if asm.pending:
            raise WeightUpdateError(f"{len(asm.pending)} tensor(s) incomplete after the apply pass")
        self.last = {"bytes": asm.received, "senders": len(v.infos), "passes": 2, "verify_s": v.seconds,
                     "apply_s": time.perf_counter() - t1}
        return asm.received

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.receivers = {}


def _unit_index(metas: list[TensorMeta], manifest: dict) -> list[list[int]]:
    from .stream import unit_plan

    return [[i for i, _ in unit] for unit in unit_plan(metas, int(manifest["bucket_bytes"]))]


def _parallel(fn: Callable[[int, dict], None], infos: Mapping[int, dict] | Sequence[dict]) -> None:
    items = infos.items() if isinstance(infos, Mapping) else enumerate(infos)
    threads = [threading.Thread(target=fn, args=(i, info), daemon=True) for i, info in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
