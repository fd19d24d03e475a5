"""A prefill replica answers once its prompt's KV and routing rows are in the Mooncake pool.

Prefill/decode disaggregation over moerl's KV pool runs a request in two hops: the prompt with
``max_tokens`` 1 on a prefill replica, then the request on a decode replica, which loads the
prompt's blocks (and their routing rows) from the pool. vLLM answers the first hop when its step
is done, while the step's puts are still queued for the store; a decode replica asked at that
moment finds part of the prompt missing and computes it again (correct, but the hand-over is lost).

`PrefillHandoff` closes that gap on the prefill side, so whoever makes the two hops needs nothing
else: `moerl rl` (``rl_loop.disagg``, for the embedded router and for llm-d's prefill/decode
profiles) and llm-d's own ``pd-sidecar`` (``--kv-connector shared-storage``: prefill, wait for the
answer, then decode). Start prefill replicas with vLLM's own middleware option::

    vllm serve ... --kv-transfer-config '{"kv_connector": "MoerlMooncakeStoreConnector", ...}' \\
        --worker-extension-cls vllm_ext.kv_pool.KvPoolWorkerExtension \\
        --middleware vllm_ext.prefill_handoff.PrefillHandoff

(`rl_loop.kv_pool.connector_args` adds both for the replicas `moerl rl` starts as prefill replicas).
Each successful generation answer is held until every put queued so far has been stored, through
the worker extension's ``moerl_flush_kv_pool`` (vLLM's ``collective_rpc``), and leaves with
``x-moerl-kv-pool: stored <seconds>``; after `FLUSH_TIMEOUT_S` (the store slow or gone) it leaves
with ``x-moerl-kv-pool: timeout`` and the decode replica computes what the pool lacks. A streamed
answer is held whole (a prefill answer is one token). The flush is a worker call, so the replica's
engine loop waits while it drains the queue: milliseconds when the store answers (``prefill_s_mean``
in `moerl rl`'s metrics.jsonl includes it), at most `FLUSH_TIMEOUT_S` when it does not.
"""

from __future__ import annotations

import logging
import time

__all__ = ["FLUSH_TIMEOUT_S", "HEADER", "PrefillHandoff"]

logger = logging.getLogger(__name__)

HEADER = "x-moerl-kv-pool"
FLUSH_TIMEOUT_S = 30.0
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


async def flush(engine_client, timeout_s: float) -> str:
    """This replica's queued puts stored: the header value (``stored <s>``, ``timeout``, ``error: ...``)."""
    t0 = time.perf_counter()
    try:
        done = await engine_client.collective_rpc("moerl_flush_kv_pool", args=(timeout_s,))
    except Exception as exc:  # noqa: BLE001 - said in the answer and the log; the answer itself still goes
        logger.error("moerl prefill hand-off: the pool could not be flushed (%s: %s); decode replicas will "
                     "recompute this replica's prompts", type(exc).__name__, exc)
        return f"error: {type(exc).__name__}: {exc}"[:200]
    return f"stored {time.perf_counter() - t0:.6f}" if all(done) else "timeout"


class PrefillHandoff:
    """ASGI middleware (vLLM ``--middleware vllm_ext.prefill_handoff.PrefillHandoff``): see the module doc."""

    def __init__(self, app, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        held: list[dict] = []

        async def hold(message: dict) -> None:
            held.append(message)
            if message["type"] != "http.response.body" or message.get("more_body", False):
                return
            start = held[0]
            if start["type"] == "http.response.start" and start["status"] == 200:
                value = await flush(scope["app"].state.engine_client, self.timeout_s)
                start["headers"] = [*start.get("headers", []), (HEADER.encode(), value.encode())]
            for m in held:
                await send(m)
            held.clear()

        await self.app(scope, receive, hold)
