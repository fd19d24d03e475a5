"""The routing record in OpenAI responses (API-server side of the plugin).

vLLM already carries captured rows to the API server
(``CompletionOutput.routed_experts``, an array ``[rows, L, K]``) and already
has the request field ``routed_experts_prompt_start`` (rows from a prompt
position on, so a multi-turn request receives only new rows) and the
response field ``routed_experts`` on every choice of ``/v1/completions`` and
``/v1/chat/completions``. vLLM fills that field only in non-streaming
responses and as a base64 ``.npy``. With this plugin the same field carries
the moerl routing payload instead (base64 of ``vllm_ext.routing.record``'s
codec: self-describing, with MoE layer indices, expert count and first
position), in non-streaming responses and in the final chunk of each choice
when streaming. Decode with ``vllm_ext.routing.record.decode_record_b64``.

A choice whose routing was lost (``vllm_ext.routing.missing``) has
``routed_experts: null`` and ``routed_experts_error: "<reason>: <detail>"`` in
the same places, and its reason is counted in ``moerl:routing_missing_total``
(``mark_missing``). A model without MoE layers gets neither field.

The logic (``encode_rows``, ``moe_layer_indices``, ``inject_into_chunk``) is
plain functions; ``vllm_ext.serving`` calls them from its one wrapper per vLLM
serving method.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import numpy as np

from .metrics import routing_missing
from .routing.missing import ENCODE_FAILED, RoutingMissing
from .routing.record import IndexKeys, RoutingRecord, encode_record_b64

logger = logging.getLogger("vllm_ext.routing")

__all__ = ["moe_layer_indices", "num_routed_experts", "encode_rows", "encode_request_output", "annotate_errors",
           "inject_into_chunk", "mark_missing", "numpy2base64_passthrough", "ROUTING_FIELD", "ERROR_FIELD"]

ROUTING_FIELD = "routed_experts"
ERROR_FIELD = "routed_experts_error"


def num_routed_experts(hf_config: Any) -> int:
    for name in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"):
        v = getattr(hf_config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError("cannot find the number of routed experts in the model config")


def moe_layer_indices(hf_config: Any, num_moe_layers: int | None = None) -> tuple[int, ...]:
    """Decoder layers that are MoE, from the HF config (dense layers dropped).

    Covers the conventions of Qwen-MoE (``mlp_only_layers``,
    ``decoder_sparse_step``), DeepSeek-V3/Kimi-K2/GLM (``first_k_dense_replace``,
    ``moe_layer_freq``) and explicit ``mlp_layer_types``; the count is checked
    against the captured columns when given.
    """
    cfg = getattr(hf_config, "text_config", None) or hf_config
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "mlp_layer_types", None)
    if types:
        layers = [i for i, t in enumerate(types) if str(t).lower() in ("sparse", "moe")]
    elif hasattr(cfg, "first_k_dense_replace") or hasattr(cfg, "moe_layer_freq"):
        k = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
        layers = [i for i in range(n) if i >= k and i % freq == 0]
    else:
        dense = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if num_moe_layers is not None and len(layers) != num_moe_layers:
        raise ValueError(f"config gives {len(layers)} MoE layers but the record has {num_moe_layers} columns")
    return tuple(layers)


def encode_rows(rows: np.ndarray, hf_config: Any, start: int, index_keys: np.ndarray | None = None) -> str:
    """Captured rows of one choice (and the DSA indexer's keys `[rows, layers, index_topk]`, when
    captured) -> the base64 payload for the response.

    vLLM's own capture (GPU, Model Runner V2) returns every decoder layer,
    dense ones as zeros: those columns are dropped, so the record is the same
    whichever capture produced it."""
    layers, num_experts, num_layers = _routing_shape(hf_config)
    if rows.shape[1] != len(layers) and rows.shape[1] == num_layers:
        rows = rows[:, list(layers)]
    keys = None
    if index_keys is not None:
        if index_keys.shape[1] != num_layers:
            raise ValueError(f"indexer keys have {index_keys.shape[1]} layer columns; the model has {num_layers} "
                             "decoder layers, each with an indexer")
        keys = IndexKeys(index_keys, tuple(range(num_layers)), int(index_keys.shape[2]))
    return encode_record_b64(RoutingRecord(rows, layers, num_experts, start, keys))


_shapes: dict[int, tuple[Any, tuple[tuple[int, ...], int, int]]] = {}


def _routing_shape(hf_config: Any) -> tuple[tuple[int, ...], int, int]:
    """(MoE layer indices, routed experts, decoder layers) of a served model, computed once
    per config object (attribute reads on transformers configs are slow, and this runs per response)."""
    hit = _shapes.get(id(hf_config))
    if hit is None or hit[0] is not hf_config:
        cfg = getattr(hf_config, "text_config", None) or hf_config
        hit = _shapes[id(hf_config)] = (hf_config, (moe_layer_indices(hf_config), num_routed_experts(hf_config),
                                                    int(cfg.num_hidden_layers)))
    return hit[1]


class _Encoded(str):
    """A finished payload travelling where vLLM expects an array."""


def _prompt_start(request: Any, prompt_len: int) -> int:
    return min(int(getattr(request, "routed_experts_prompt_start", 0) or 0), prompt_len)


def mark_missing(output: Any, exc: RoutingMissing) -> None:
    """`output` (a finished ``CompletionOutput``) gets no routing: its choice says why, the reason is counted."""
    output.routed_experts = None
    setattr(output, ERROR_FIELD, exc.field)
    routing_missing.inc(exc.reason)
    logger.error("moerl routing: %s", exc.field)


def _routing_fields(output: Any, prompt_len: int, request: Any, hf_config: Any) -> dict[str, str]:
    """The routing fields of one finished output's choice: the record, or why it is missing, or none."""
    err = getattr(output, ERROR_FIELD, None)
    if err is not None:
        return {ERROR_FIELD: err}
    arr = getattr(output, "routed_experts", None)
    if arr is None:
        return {}
    if not isinstance(arr, _Encoded):
        try:
            arr = output.routed_experts = _Encoded(encode_rows(np.asarray(arr), hf_config,
                                                               _prompt_start(request, prompt_len),
                                                               getattr(output, "moerl_index_keys", None)))
        except ValueError as exc:
            mark_missing(output, RoutingMissing(ENCODE_FAILED, f"cannot encode the routing record: {exc}"))
            return {ERROR_FIELD: getattr(output, ERROR_FIELD)}
    return {ROUTING_FIELD: arr}


def encode_request_output(res: Any, request: Any, hf_config: Any) -> dict[int, dict[str, str]]:
    """Routing fields of each finished output of `res`, by output index (encoded once, in place).

    Per output, not per request: when streaming with n > 1, a sample that finishes before
    its siblings comes in a result that is not finished yet, and its chunk is its last."""
    out: dict[int, dict[str, str]] = {}
    plen = len(res.prompt_token_ids or [])
    for o in res.outputs:
        if getattr(o, "finish_reason", None) is None:
            continue
        fields = _routing_fields(o, plen, request, hf_config)
        if fields:
            out[o.index] = fields
    return out


def annotate_errors(choices: list, outputs: list) -> None:
    """Non-streaming: vLLM built each choice's ``routed_experts`` from its output; add the error field."""
    for ch, o in zip(choices, outputs):
        err = getattr(o, ERROR_FIELD, None)
        if err is not None:
            setattr(ch, ERROR_FIELD, err)


def inject_into_chunk(chunk: str, fields_by_index: dict[int, dict[str, str]]) -> str:
    """Add each choice's routing fields (``routed_experts`` or ``routed_experts_error``) to the
    choices of an SSE chunk that carry a finish_reason (the final chunk of that choice)."""
    if not fields_by_index or not chunk.startswith("data: ") or '"finish_reason":' not in chunk:
        return chunk
    body = chunk[len("data: ") :].strip()
    if body == "[DONE]":
        return chunk
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return chunk
    changed = False
    for ch in obj.get("choices") or []:
        if ch.get("finish_reason") is not None and ch.get("index") in fields_by_index:
            ch.update(fields_by_index.pop(ch["index"]))
            changed = True
    if not changed:
        return chunk
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def numpy2base64_passthrough(orig):
    @functools.wraps(orig)
    def f(arr):
        if isinstance(arr, _Encoded):
            return str(arr)
        return orig(arr)

    return f


def decode_response_routing(choice: dict[str, Any]) -> RoutingRecord | None:
    """Client helper: the record of one response choice (None if absent)."""
    from .routing.record import decode_record_b64

    text = choice.get(ROUTING_FIELD)
    return None if text is None else decode_record_b64(text)
