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

``vllm_ext.serving`` adds the fields (its one wrapper per serving method, beside the
routing record); the AsyncLLM wrappers are this module's ``PATCHES``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import patches

from ..metrics import state, version_number

logger = logging.getLogger("vllm_ext.weights")


def spans_of(output: Any) -> list[dict] | None:
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    return [{"version": version_number(s.version), "start": s.start, "end": s.end} for s in spans]


def annotate(choice: Any, output: Any) -> None:
    spans = spans_of(output)
    if spans is None:
        spans = [{"version": state.version, "start": 0, "end": len(getattr(output, "token_ids", []) or [])}]
    setattr(choice, "weight_versions", spans)
    setattr(choice, "policy_version", spans[-1]["version"] if spans else state.version)


def _state_hook(before=None, after=None, on_error=None):
    """A wrapper of an async AsyncLLM control call that keeps `state` current around it."""

    def wrap(orig):
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

        return f

    return wrap


def _failed(exc: BaseException) -> None:
    state.fail(f"{type(exc).__name__}: {exc}")
    logger.error("moerl weights: update failed, previous weights keep serving: %s", exc)


def _finished(weight_version: str | None = None, *a, **k) -> None:
    kw = {"updating": False}
    if weight_version is not None:
        kw["version"] = version_number(weight_version)
    state.set(**kw)


def _new_version(new_version: str, *a, **k) -> None:
    state.set(version=version_number(new_version))


def _engine_patch(method: str, params: list[str], hook, symptom: str, required: bool = True) -> patches.Patch:
    return patches.wrapper_patch(
        f"vllm_asyncllm_{method}", f"vllm.v1.engine.async_llm:AsyncLLM.{method}", hook, versions="vllm>=0.32,<0.33",
        params=["self", *params], upstream=f"vLLM 0.32.0 AsyncLLM.{method} (the dev-mode RL routes)", symptom=symptom,
        required=required)


_STALE = "moerl:weight_update_in_progress stays wrong: the router sends requests to a paused or updating replica"
PATCHES = (
    _engine_patch("pause_generation", ["mode", "clear_cache"],
                  _state_hook(after=lambda *a, **k: state.set(paused=True)), _STALE),
    _engine_patch("resume_generation", [], _state_hook(after=lambda *a, **k: state.set(paused=False)), _STALE),
    _engine_patch("start_weight_update", [], _state_hook(before=lambda *a, **k: state.set(updating=True),
                                                         on_error=_failed), _STALE),
    _engine_patch("update_weights", ["request"], _state_hook(on_error=_failed),
                  "a failed update is not counted in moerl:weight_update_failures"),
    _engine_patch("finish_weight_update", ["weight_version"], _state_hook(after=_finished, on_error=_failed),
                  "moerl:policy_version stays at the old version after an update"),
    # moerl's own updates name the version in finish_weight_update; this route is for other clients
    _engine_patch("update_weight_version", ["new_version"], _state_hook(after=_new_version),
                  "/update_weight_version does not move moerl:policy_version", required=False),
)
