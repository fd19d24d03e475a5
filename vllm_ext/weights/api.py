"""API-server side of weight sync: policy version in responses, state on /metrics.

* Every non-streaming ``/v1/completions`` and ``/v1/chat/completions`` choice
  gets ``weight_versions``: ``[{"version": V, "start": i, "end": j}, ...]``
  (output tokens ``[i, j)`` were sampled by policy version ``V``; several spans
  when an update landed while the request was paused and kept) and
  ``policy_version`` (the version of its last token). The spans come from vLLM's
  own per-token tracking (``CompletionOutput.weight_versions``).
* ``AsyncLLM``'s pause/resume and weight-update calls (the dev-mode routes
  ``/pause``, ``/resume``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/update_weight_version``) keep
  ``vllm_ext.metrics.state`` current, so ``moerl:policy_version`` and
  ``moerl:weight_update_in_progress`` follow them; a failed ``/update_weights``
  counts in ``moerl:weight_update_failures`` and answers with vLLM's JSON error
  carrying the worker's message.
* ``POST /moerl/swap_weights`` (``swap.py``): a sharded update's pause, apply,
  finish and resume as one request.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from ..metrics import state, version_number
from . import swap

logger = logging.getLogger("vllm_ext.weights")

_installed = False


def spans_of(output: Any) -> list[dict] | None:
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    return [{"version": version_number(s.version), "start": s.start, "end": s.end} for s in spans]


def _annotate(choice: Any, output: Any) -> None:
    spans = spans_of(output)
    if spans is None:
        spans = [{"version": state.version, "start": 0, "end": len(getattr(output, "token_ids", []) or [])}]
    setattr(choice, "weight_versions", spans)
    setattr(choice, "policy_version", spans[-1]["version"] if spans else state.version)


def install() -> None:
    """Wrap AsyncLLM's control calls and the completion/chat response builders (API-server process)."""
    global _installed
    if _installed:
        return
    _installed = True
    state.install()
    _install_engine_hooks()
    _install_response_hooks()
    swap.install()


def _install_engine_hooks() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    def wrap(name, before=None, after=None, on_error=None):
        orig = getattr(AsyncLLM, name)

        @functools.wraps(orig)
        async def f(self, *args, **kwargs):
            if before:
                before(*args, **kwargs)
            try:
                out = await orig(self, *args, **kwargs)
            except BaseException as exc:
                if on_error:
                    on_error(exc)
                raise
            if after:
                after(*args, **kwargs)
            return out

        setattr(AsyncLLM, name, f)

    def failed(exc: BaseException) -> None:
        state.fail(f"{type(exc).__name__}: {exc}")
        logger.error("moerl weights: update failed, previous weights keep serving: %s", exc)

    def finished(weight_version: str | None = None, *a, **k) -> None:
        kw = {"updating": False}
        if weight_version is not None:
            kw["version"] = version_number(weight_version)
        state.set(**kw)

    def new_version(new_version: str, *a, **k) -> None:
        state.set(version=version_number(new_version))

    wrap("pause_generation", after=lambda *a, **k: state.set(paused=True))
    wrap("resume_generation", after=lambda *a, **k: state.set(paused=False))
    wrap("start_weight_update", before=lambda *a, **k: state.set(updating=True), on_error=failed)
    wrap("update_weights", on_error=failed)
    wrap("finish_weight_update", after=finished, on_error=failed)
    wrap("update_weight_version", after=new_version)


def _install_response_hooks() -> None:
    try:
        from vllm.entrypoints.openai.chat_completion import serving as chat_mod
        from vllm.entrypoints.openai.completion import serving as cmpl_mod
    except Exception as exc:  # engine-only processes lack the API stack
        logger.debug("moerl weights: response hooks not installed: %s", exc)
        return

    Cmpl = cmpl_mod.OpenAIServingCompletion
    orig_to_resp = Cmpl.request_output_to_completion_response

    @functools.wraps(orig_to_resp)
    def to_resp(self, final_res_batch, request, *args, **kwargs):
        resp = orig_to_resp(self, final_res_batch, request, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]
        choices = getattr(resp, "choices", None) or []
        if len(choices) == len(outputs):
            for ch, o in zip(choices, outputs):
                _annotate(ch, o)
        return resp

    Cmpl.request_output_to_completion_response = to_resp

    Chat = chat_mod.OpenAIServingChat
    orig_chat_full = Chat.chat_completion_full_generator

    @functools.wraps(orig_chat_full)
    async def chat_full(self, request, result_generator, *args, **kwargs):
        last: list[Any] = []

        async def watch() -> AsyncIterator:
            async for res in result_generator:
                last[:] = [res]
                yield res

        resp = await orig_chat_full(self, request, watch(), *args, **kwargs)
        choices = getattr(resp, "choices", None)
        if last and choices:
            by_index = {o.index: o for o in last[0].outputs}
            for ch in choices:
                o = by_index.get(getattr(ch, "index", None))
                if o is not None:
                    _annotate(ch, o)
        return resp

    Chat.chat_completion_full_generator = chat_full
