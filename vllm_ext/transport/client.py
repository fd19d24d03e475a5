"""Trainer-side driver of a weight update on one or more vLLM replicas.

The protocol, per replica: ``POST /pause?mode=keep`` (in-flight requests are
frozen, not dropped) -> ``/start_weight_update`` -> ``/update_weights`` (one
complete update, see ``vllm_ext.weights.engine``) -> ``/finish_weight_update`` with the new
version -> ``/resume``. If any step fails the replica is resumed on its previous
weights and version and ``WeightSyncError`` carries every replica's error.
The sharded lanes (``ShardedUpdate``) start the update and move its bytes before
the pause, while the replica still serves; then one request (``SWAP_ROUTE``) has the
server pause, apply, finish and resume, so the replica stops serving only to apply.
Needs vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) and the ``moerl``
backend (``--weight-transfer-config '{"backend": "moerl"}'``).

HTTP with the standard library only; streaming also needs torch (``stream.py``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SWAP_ROUTE = "/moerl/swap_weights"  # served by vllm_ext.weights.swap

__all__ = ["SWAP_ROUTE", "WeightSyncError", "SyncResult", "Replica", "ShardedUpdate", "push_fs", "push_stream", "push_sharded",
           "publish_fs"]


class WeightSyncError(RuntimeError):
    """What failed, per replica; ``hung``: the indices of replicas whose update request had
    no answer in time (left paused, their requests running: take them out of rotation)."""

    def __init__(self, message: str, hung: Sequence[int] = ()):
        super().__init__(message)
        self.hung = list(hung)


@dataclass
class SyncResult:
    version: int
    transport: str
    bytes: int = 0
    seconds: float = 0.0  # first pause to last resume
    transfer_seconds: float = 0.0  # the /update_weights calls (receive + check + apply)
    per_replica: dict[str, dict] = field(default_factory=dict)


class Replica:
    def __init__(self, base_url: str, timeout: float = 600.0):
        self.base = base_url.rstrip("/")
        self.timeout = timeout

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                pass
            raise WeightSyncError(f"{self.base}{path}: HTTP {exc.code}: {detail}") from None
        except OSError as exc:
            raise WeightSyncError(f"{self.base}{path}: {exc}") from None
        return json.loads(raw) if raw else {}

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=self.timeout) as r:
            return json.loads(r.read())

    def version(self) -> str:
        return self.get("/weight_info")["weight_version"]


def _each(fn: Callable[[int], None], indices: Sequence[int], within_s: float | None = None) -> dict[int, Exception]:
    """fn(i) for every index at once (one thread each: the replicas answer independently, so
    n round trips cost one); the failures by index. With `within_s`, one still running then
    is left behind and fails with ``_NoAnswer``."""
    failures: dict[int, Exception] = {}

    def run(i: int) -> None:
        try:
            fn(i)
        except Exception as exc:  # noqa: BLE001 - returned to the caller
            failures[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in indices]
    for t in threads:
        t.start()
    deadline = None if within_s is None else time.monotonic() + within_s
    for i, t in zip(indices, threads):
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            failures[i] = _NoAnswer(f"no answer within {within_s:.0f} s (a hung worker?)")
    return dict(failures)


class _NoAnswer(WeightSyncError):
    """A replica's request still unanswered at its bound."""


def _run_protocol(replicas: Sequence[Replica], version: int, transport: str,
                  update_body: Callable[[int, Replica], dict],
                  during: Callable[[], int] | None = None) -> SyncResult:
    """pause -> start -> update (plus `during` in this thread) -> finish -> resume, each step on
    all replicas concurrently. A replica failing to pause or start ends the update for all;
    every paused replica is resumed."""
    res = SyncResult(version=int(version), transport=transport)
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    paused: list[Replica] = []

    def prepare(i: int) -> None:
        replicas[i].post("/pause?mode=keep")
        paused.append(replicas[i])
        replicas[i].post("/start_weight_update")

    def raise_first(failures: dict[int, Exception]) -> None:
        for _, exc in sorted(failures.items()):
            raise exc

    try:
        raise_first(_each(prepare, range(len(replicas))))
        t1 = time.perf_counter()
        ok: dict[str, bool] = {}

        def update(i: int, r: Replica) -> None:
            try:
                r.post("/update_weights", {"update_info": update_body(i, r)})
                ok[r.base] = True
            except Exception as exc:  # noqa: BLE001
                errors[r.base] = str(exc)

        threads = [threading.Thread(target=update, args=(i, r), daemon=True) for i, r in enumerate(replicas)]
        for t in threads:
            t.start()
        try:
            if during is not None:
                res.bytes = during()
        except Exception as exc:  # noqa: BLE001
            errors["sender"] = f"{type(exc).__name__}: {exc}"
        for t in threads:
            t.join()
        res.transfer_seconds = time.perf_counter() - t1
        done = [i for i, r in enumerate(replicas) if ok.get(r.base)]
        raise_first(_each(lambda i: replicas[i].post("/finish_weight_update", {"weight_version": str(int(version))}),
                          done))
    except WeightSyncError as exc:
        errors.setdefault("protocol", str(exc))
    finally:
        for i, exc in sorted(_each(lambda i: paused[i].post("/resume"), range(len(paused))).items()):
            errors.setdefault(paused[i].base + " resume", str(exc))
        res.seconds = time.perf_counter() - t0
    if errors:
        raise WeightSyncError(f"weight update to version {version} failed: "
                              + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    return res


def push_fs(replicas: Sequence[Replica | str], path: str | Path, version: int) -> SyncResult:
    """Make replicas load a committed directory (written by ``publish_fs`` / ``wire.write_fs``)."""
    reps = [r if isinstance(r, Replica) else Replica(r) for r in replicas]
    body = {"transport": "fs", "path": str(Path(path).resolve()), "version": int(version)}
    return _run_protocol(reps, version, "fs", lambda i, r: body)


class ShardedUpdate:
    """One update of every replica from the trainer ranks' sharded senders, in two halves.

    ``workers[i][t]``: for TP rank t of replica i, the join info of every trainer rank's
    sender for that worker (``sharded.ShardedSender.update_infos``); the ranks send
    themselves, in their own processes. ``begin`` starts the update on every replica
    (``/start_weight_update``, ``/update_weights`` phase "receive"): each worker receives
    and verifies in the background while the replica serves the old version. ``swap`` has
    each server pause, apply (phase "apply": it waits for the bytes still moving), finish
    and resume in one request, so a replica stops serving only to apply. A replica that fails, or has not
    answered within ``answer_within_s``, drops out alone: ``lost(i, why)`` at once (tell
    the senders, whose lanes to it would otherwise wait for it), and the others finish."""

    def __init__(self, replicas: Sequence[Replica | str], workers: Sequence[Sequence[Sequence[dict]]], version: int,
                 lost: Callable[[int, str], None] | None = None, answer_within_s: float | None = None):
        self.replicas = [r if isinstance(r, Replica) else Replica(r) for r in replicas]
        self.workers, self.version = workers, int(version)
        self.lost = lost or (lambda i, why: None)
        self.answer_within_s = answer_within_s
        self.begun: list[int] = []
        self.hung: list[int] = []  # no answer in time, in either half: left as they are, out of this update
        self.errors: dict[str, str] = {}

    def _body(self, i: int, phase: str) -> dict:
        return {"update_info": {"transport": "sharded", "version": self.version, "workers": self.workers[i],
                                "phase": phase}}

    def _drop(self, failures: dict[int, Exception]) -> dict[int, Exception]:
        """Each failed replica out of this update, its error kept and ``lost`` told; one without an
        answer in time is hung."""
        for i, exc in sorted(failures.items()):
            self.errors[self.replicas[i].base] = str(exc)
            self.lost(i, str(exc))
            if isinstance(exc, _NoAnswer):
                self.hung.append(i)
        return failures

    def begin(self) -> None:
        def start(i: int) -> None:
            self.replicas[i].post("/start_weight_update")
            self.replicas[i].post("/update_weights", self._body(i, "receive"))

        failures = self._drop(_each(start, range(len(self.replicas)), self.answer_within_s))
        self.begun = [i for i in range(len(self.replicas)) if i not in failures]

    def swap(self) -> SyncResult:
        """The second half, one request to each replica that began (``SWAP_ROUTE``: the server
        pauses, applies, finishes and resumes); raises ``WeightSyncError`` naming every replica
        that failed in either half. ``per_replica[url]``: the seconds of each step there."""
        res = SyncResult(version=self.version, transport="sharded")
        t0 = time.perf_counter()

        def swap(i: int) -> None:
            body = self._body(i, "apply")
            res.per_replica[self.replicas[i].base] = self.replicas[i].post(
                SWAP_ROUTE, {**body, "weight_version": str(self.version)})

        self._drop(_each(swap, self.begun, self.answer_within_s))
        res.seconds = res.transfer_seconds = time.perf_counter() - t0
        if self.errors:
            raise WeightSyncError(f"weight update to version {self.version} failed: "
                                  + "; ".join(f"{k}: {v}" for k, v in self.errors.items()), hung=sorted(self.hung))
        return res


def push_sharded(replicas: Sequence[Replica | str], workers: Sequence[Sequence[Sequence[dict]]],
                 version: int, lost: Callable[[int, str], None] | None = None,
                 answer_within_s: float | None = None) -> SyncResult:
    """Both halves of a ``ShardedUpdate`` in a row."""
    update = ShardedUpdate(replicas, workers, version, lost, answer_within_s)
    update.begin()
    return update.swap()


def publish_fs(path: str | Path, tensors, version: int, **kw) -> dict:
    """Write a version for ``push_fs`` (layer by layer as ``tensors`` yields)."""
    from .wire import write_fs

    return write_fs(path, tensors, version, **kw)


def push_stream(replicas: Sequence[Replica | str], metas, tensors: Iterable, version: int, *,
                addr: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                bucket_bytes: int = 64 << 20, streams: int = 2, shm: bool = True, sender=None) -> SyncResult:
    """Stream one update to every replica at once (this process is rank 0, the replicas 1..n).

    ``metas``: ``format.TensorMeta`` for every tensor, in order; ``tensors``: the
    tensors (or (name, tensor) pairs) in the same order, produced lazily (e.g.
    ``titan_ext.weights.iter_hf_weights``). Replicas on this host read a
    shared-memory ring, the others get gloo broadcasts; ``shm=False`` forces the
    network path for all. ``per_replica[url]["lane"]`` says which each took.
    A ``sender`` (``stream.StreamSender``) kept across updates keeps its gloo
    groups and ring: only the first update pays for building them."""
    from .shm import RingShape
    from .stream import StreamSender

    reps = [r if isinstance(r, Replica) else Replica(r) for r in replicas]
    s = sender or StreamSender(1 + len(reps), addr=addr, port=port, timeout_s=timeout_s,
                               bucket_bytes=bucket_bytes, streams=streams, shm=RingShape() if shm else None)
    try:
        res = _run_protocol(reps, version, "stream", lambda i, r: s.update_info(i + 1, version),
                            during=lambda: s.send(list(metas), tensors, version))
        res.per_replica = {r.base: {"lane": s.lanes.get(i + 1)} for i, r in enumerate(reps)}
    finally:
        if sender is None:
            s.close()
    return res
