"""The plugin's one wrapper per vLLM serving method (API-server process).

Two features add fields to completion and chat responses: the routing record
(``vllm_ext.api``: ``routed_experts`` / ``routed_experts_error``, streaming too) and
the policy version (``vllm_ext.weights.api``: ``weight_versions`` and
``policy_version`` on non-streaming choices). Both need the same serving methods; each
method is wrapped once, here, and does both jobs in a fixed order: the routing record is
encoded from the outputs before vLLM builds the response, then, on the built response,
the routing errors and then the versions are added. Which features run is decided when
the plugin registers (``enable``). A response of a process that skipped an optional
patch names it in ``moerl_patches_skipped``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import patches

from . import api as routing
from .metrics import routing_missing
from .routing.missing import REASONS
from .weights import api as weights

__all__ = ["enable", "PATCHES", "SKIPPED_FIELD"]

SKIPPED_FIELD = "moerl_patches_skipped"
_VERSIONS = "vllm>=0.32,<0.33"
_CMPL = "vllm.entrypoints.openai.completion.serving"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving"

_features = {"routing": False, "weights": False}


def enable(*, routing_on: bool, weights_on: bool) -> list[patches.Patch]:
    """Turn the features on (never off: a process keeps what it registered); returns the patches they need."""
    _features["routing"] |= routing_on
    _features["weights"] |= weights_on
    if routing_on:
        routing_missing.install(REASONS)
    return list(PATCHES) if any(_features.values()) else []


def _routing() -> bool:
    return _features["routing"]


def _weights() -> bool:
    return _features["weights"]


def _note_skipped(resp: Any) -> None:
    names = sorted(patches.skipped())
    if names and resp is not None:
        setattr(resp, SKIPPED_FIELD, names)


def _annotate_versions(choices: list, outputs: list) -> None:
    if len(choices) == len(outputs):
        for ch, o in zip(choices, outputs):
            if o is not None:
                weights.annotate(ch, o)


def completion_response(orig):
    @functools.wraps(orig)
    def request_output_to_completion_response(self, final_res_batch, request, *args, **kwargs):
        if _routing():
            hf = self.model_config.hf_config
            for res in final_res_batch:
                routing.encode_request_output(res, request, hf)
        resp = orig(self, final_res_batch, request, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]
        choices = getattr(resp, "choices", None) or []
        if _routing():
            routing.annotate_errors(choices, outputs)
        if _weights():
            _annotate_versions(choices, outputs)
        _note_skipped(resp)
        return resp

    return request_output_to_completion_response


def completion_stream(orig):
    @functools.wraps(orig)
    async def completion_stream_generator(self, request, engine_inputs, result_generator, *args, **kwargs):
        if not _routing():
            async for chunk in orig(self, request, engine_inputs, result_generator, *args, **kwargs):
                yield chunk
            return
        hf = self.model_config.hf_config
        n = 1 if request.n is None else request.n
        pending: dict[int, dict[str, str]] = {}

        async def watch() -> AsyncIterator:
            async for prompt_idx, res in result_generator:
                for idx, enc in routing.encode_request_output(res, request, hf).items():
                    pending[prompt_idx * n + idx] = enc
                yield prompt_idx, res

        async for chunk in orig(self, request, engine_inputs, watch(), *args, **kwargs):
            yield routing.inject_into_chunk(chunk, pending)

    return completion_stream_generator


def chat_full(orig):
    @functools.wraps(orig)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        hf = self.model_config.hf_config
        outputs: dict[int, Any] = {}
        last: list[Any] = []

        async def watch() -> AsyncIterator:
            async for res in result_generator:
                if _routing():
                    routing.encode_request_output(res, request, hf)
                outputs.update((o.index, o) for o in res.outputs)
                last[:] = [res]
                yield res

        resp = await orig(self, request, watch(), *args, **kwargs)
        choices = getattr(resp, "choices", None) or []
        if _routing():
            routing.annotate_errors(choices, [outputs.get(ch.index) for ch in choices])
        if _weights() and last and choices:
            by_index = {o.index: o for o in last[0].outputs}
            for ch in choices:
                o = by_index.get(getattr(ch, "index", None))
                if o is not None:
                    weights.annotate(ch, o)
        _note_skipped(resp)
        return resp

    return chat_completion_full_generator


def chat_stream(orig):
    @functools.wraps(orig)
    async def chat_completion_stream_generator(self, request, result_generator, *args, **kwargs):
        if not _routing():
            async for chunk in orig(self, request, result_generator, *args, **kwargs):
                yield chunk
            return
        hf = self.model_config.hf_config
        pending: dict[int, dict[str, str]] = {}

        async def watch() -> AsyncIterator:
            async for res in result_generator:
                pending.update(routing.encode_request_output(res, request, hf))
                yield res

        async for chunk in orig(self, request, watch(), *args, **kwargs):
            yield routing.inject_into_chunk(chunk, pending)

    return chat_completion_stream_generator


def _serving_patch(name: str, target: str, wrap, params: list[str], symptom: str) -> patches.Patch:
    return patches.wrapper_patch(name, target, wrap, versions=_VERSIONS, params=params, symptom=symptom,
                                 upstream=f"vLLM 0.32.0 OpenAI serving ({target})")


_NO_ROUTING = "responses carry no routed_experts"
PATCHES = (
    _serving_patch("vllm_completion_numpy2base64", f"{_CMPL}:numpy2base64", routing.numpy2base64_passthrough,
                   ["array"], f"{_NO_ROUTING}: vLLM re-encodes the payload as .npy"),
    _serving_patch("vllm_chat_numpy2base64", f"{_CHAT}:numpy2base64", routing.numpy2base64_passthrough,
                   ["array"], f"{_NO_ROUTING}: vLLM re-encodes the payload as .npy"),
    _serving_patch("vllm_completion_response", f"{_CMPL}:OpenAIServingCompletion.request_output_to_completion_response",
                   completion_response, ["self", "final_res_batch", "request", "request_id", "created_time",
                                         "model_name", "tokenizer", "request_metadata"],
                   f"{_NO_ROUTING} nor weight_versions (/v1/completions)"),
    _serving_patch("vllm_completion_stream", f"{_CMPL}:OpenAIServingCompletion.completion_stream_generator",
                   completion_stream, ["self", "request", "engine_inputs", "result_generator", "request_id",
                                       "created_time", "model_name", "num_prompts", "tokenizer", "request_metadata"],
                   f"{_NO_ROUTING} (streamed /v1/completions)"),
    _serving_patch("vllm_chat_response", f"{_CHAT}:OpenAIServingChat.chat_completion_full_generator", chat_full,
                   ["self", "request", "result_generator", "request_id", "model_name", "conversation", "tokenizer",
                    "request_metadata", "parser", "mm_token_counts"],
                   f"{_NO_ROUTING} nor weight_versions (/v1/chat/completions)"),
    _serving_patch("vllm_chat_stream", f"{_CHAT}:OpenAIServingChat.chat_completion_stream_generator", chat_stream,
                   ["self", "request", "result_generator", "request_id", "model_name", "conversation", "tokenizer",
                    "request_metadata", "chat_template_kwargs", "mm_token_counts"],
                   f"{_NO_ROUTING} (streamed /v1/chat/completions)"),
)
