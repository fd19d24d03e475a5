"""moerl's HTTP routes on a vLLM API server, beside vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``).

* ``POST /moerl/swap_weights``: the paused half of a sharded weight update (``weights.swap``).
* ``POST /moerl/kv_pool/flush``: answers once every KV block and routing row this replica has
  queued for the Mooncake pool is stored (body ``{"timeout_s": 30}``, optional). A prefill
  replica's response leaves when its step is done, with the step's puts still queued; the
  orchestrator asks this before it sends the request to a decode replica (``rl_loop.disagg``),
  so the decode replica finds the prompt in the pool instead of recomputing it. Answers
  ``{"seconds": s}``; 504 when puts are still pending at the timeout (the store is slow or
  gone: the decode replica then recomputes what is missing), 500 with the worker's message when
  the replica pools no KV. The worker side is ``vllm_ext.kv_pool.KvPoolWorkerExtension``.

One patch adds both, wrapping vLLM's ``register_rl_api_routers``.
"""

# no ``from __future__ import annotations``: FastAPI reads the routes' parameter annotations,
# and ``Request`` is imported inside ``_flush_router``
import functools
import json
import time
from http import HTTPStatus

import patches

__all__ = ["FLUSH_ROUTE", "PATCHES"]

FLUSH_ROUTE = "/moerl/kv_pool/flush"
FLUSH_TIMEOUT_S = 30.0


def _error(status: HTTPStatus, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": status.phrase, "code": status.value}},
                        status_code=status.value)


def _flush_router():
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    api = APIRouter()

    @api.post(FLUSH_ROUTE)
    async def flush_kv_pool(raw_request: Request) -> JSONResponse:
        raw = await raw_request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return _error(HTTPStatus.BAD_REQUEST, f"{FLUSH_ROUTE}: the body is not JSON")
        timeout_s = body.get("timeout_s", FLUSH_TIMEOUT_S) if isinstance(body, dict) else None
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            return _error(HTTPStatus.BAD_REQUEST, f"{FLUSH_ROUTE}: expected {{\"timeout_s\": <seconds > 0>}} or no body")
        t0 = time.perf_counter()
        try:
            done = await raw_request.app.state.engine_client.collective_rpc("moerl_flush_kv_pool", args=(timeout_s,))
        except Exception as exc:  # noqa: BLE001 - the worker's message is the answer
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        if not all(done):
            return _error(HTTPStatus.GATEWAY_TIMEOUT, f"KV pool puts still pending after {timeout_s} s")
        return JSONResponse({"seconds": round(time.perf_counter() - t0, 6)})

    return api


def with_moerl_routes(register_rl_api_routers):
    """vLLM's RL routes, and moerl's beside them."""
    from .weights import swap

    @functools.wraps(register_rl_api_routers)
    def register(app) -> None:
        register_rl_api_routers(app)
        app.include_router(swap.router())
        app.include_router(_flush_router())

    return register


PATCHES = (patches.wrapper_patch(
    "vllm_rl_routes_moerl", "vllm.entrypoints.rl.factories:register_rl_api_routers", with_moerl_routes,
    versions="vllm>=0.32,<0.33", params=["app"],
    upstream="vLLM 0.32.0 entrypoints/rl/factories.py register_rl_api_routers",
    symptom="POST /moerl/swap_weights and /moerl/kv_pool/flush answer 404: sharded weight updates cannot be "
            "applied, and decode replicas recompute prompts a prefill replica pooled"),)
