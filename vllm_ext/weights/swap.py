"""``POST /moerl/swap_weights``: the paused half of a sharded update as one request to the API server.

A sharded update's bytes move while the replica serves (``/update_weights`` with
``phase: "receive"``); what is left, pause -> apply -> finish(version) -> resume,
is the only time the replica stops serving. Driven from the trainer as four
dev-mode requests it paid four HTTP round trips, and ``AsyncLLM.pause_generation``
adds a fixed 20 ms sleep meant for aborted or drained requests' last outputs,
which a ``keep`` pause does not produce. Here the API server runs the four calls
itself, back to back, so the pause lasts as long as the apply and nothing more,
and the replica is resumed whatever fails in between (a trainer that dies
mid-swap no longer leaves it paused). Only a hung apply leaves it paused, as
before: the request then has no answer and the caller takes the replica out.

Body: ``{"update_info": {...phase "apply"...}, "weight_version": "N"}``. Answer:
the seconds of each step (``pause_s``, ``update_s``, ``finish_s``, ``resume_s``);
a failed step answers 500 with vLLM's error shape and the worker's message,
after the resume. Added beside vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``) by ``vllm_ext.routes``.
"""

# no ``from __future__ import annotations``: FastAPI reads the route's parameter annotations,
# and ``Request`` is imported inside ``_router``
import time
from http import HTTPStatus

from ..metrics import state
from ..transport.client import SWAP_ROUTE as ROUTE

__all__ = ["ROUTE", "router", "swap"]


async def swap(engine, update_info: dict, weight_version: str) -> dict[str, float]:
    """pause(keep) -> update_weights -> finish_weight_update(version) -> resume on ``engine`` (an ``AsyncLLM``)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    seconds: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        seconds[name] = now - t
        t = now

    # AsyncLLM.pause_generation(mode="keep") less its sleep: the caches are cleared as there, so no
    # prefix computed by the old weights is reused (and a KV pool connector drops its store)
    await engine.renderer.clear_mm_cache_async()
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=True)
    state.set(paused=True)
    lap("pause_s")
    try:
        await engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        lap("update_s")
        await engine.finish_weight_update(weight_version)
        lap("finish_s")
    finally:
        await engine.resume_generation()
        lap("resume_s")
    return seconds


def router():
    """The route, for `vllm_ext.routes` to add beside vLLM's RL routes."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    router = APIRouter()

    def error(status: HTTPStatus, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": status.phrase, "code": status.value}},
                            status_code=status.value)

    @router.post(ROUTE)
    async def swap_weights(raw_request: Request) -> JSONResponse:
        try:
            body = await raw_request.json()
        except ValueError:
            return error(HTTPStatus.BAD_REQUEST, f"{ROUTE}: the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("update_info"), dict) \
                or not isinstance(body.get("weight_version"), str):
            return error(HTTPStatus.BAD_REQUEST, f"{ROUTE}: expected {{\"update_info\": {{...}}, \"weight_version\": "
                                                 "\"N\"}} (vllm_ext.transport.client.ShardedUpdate sends it)")
        try:
            seconds = await swap(raw_request.app.state.engine_client, body["update_info"], body["weight_version"])
        except Exception as exc:  # noqa: BLE001 - answered, the replica resumed on its old weights
            return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        return JSONResponse(seconds)

    return router
