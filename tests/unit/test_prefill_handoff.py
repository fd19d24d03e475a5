"""`vllm_ext.prefill_handoff.PrefillHandoff`: a prefill replica's generation answers leave once the
worker's pool puts are stored, saying so in ``x-moerl-kv-pool``; a timeout, a replica without the pool
and a failed generation leave unchanged but for the header; other routes pass untouched.
FakeEngineClient stands in for vLLM's engine client (the middleware on real servers, between a
prefill and a decode replica: tests/integration/test_kv_pool.py, and behind llm-d's pd-sidecar:
tests/integration/test_llmd_pd.py)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from vllm_ext.prefill_handoff import FLUSH_TIMEOUT_S, HEADER, PrefillHandoff


class FakeEngineClient:
    """Answers `collective_rpc` with one result per worker (after `delay_s`), or raises `error`."""

    def __init__(self, results=(True,), error: Exception | None = None, delay_s: float = 0.0):
        self.results, self.error, self.delay_s = list(results), error, delay_s
        self.calls: list[tuple] = []

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        await asyncio.sleep(self.delay_s)
        if self.error:
            raise self.error
        return self.results


def client(engine: FakeEngineClient, status: int = 200) -> TestClient:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return JSONResponse({"choices": [{"text": "x"}]}, status_code=status)

    @app.post("/v1/chat/completions")
    async def chat():
        async def chunks():
            for part in (b"data: {}\n\n", b"data: [DONE]\n\n"):
                yield part
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/pause")
    async def pause():
        return JSONResponse({})

    app.add_middleware(PrefillHandoff)  # as vLLM's --middleware adds a class
    app.state.engine_client = engine
    return TestClient(app)


def test_an_answer_leaves_once_every_worker_stored_its_puts():
    engine = FakeEngineClient([True, True], delay_s=0.05)
    r = client(engine).post("/v1/completions", json={})
    assert r.status_code == 200 and r.json() == {"choices": [{"text": "x"}]}
    state, seconds = r.headers[HEADER].split()
    assert state == "stored" and float(seconds) >= 0.05
    assert engine.calls == [("moerl_flush_kv_pool", (FLUSH_TIMEOUT_S,))]


def test_a_streamed_answer_is_held_whole_then_flushed():
    engine = FakeEngineClient()
    r = client(engine).post("/v1/chat/completions", json={})
    assert r.text == "data: {}\n\ndata: [DONE]\n\n" and r.headers[HEADER].startswith("stored ")
    assert len(engine.calls) == 1


def test_puts_still_pending_at_the_timeout_say_so():
    r = client(FakeEngineClient([True, False])).post("/v1/completions", json={})
    assert r.status_code == 200 and r.headers[HEADER] == "timeout"


def test_a_replica_without_the_pool_answers_with_the_workers_message():
    error = RuntimeError("this replica pools no KV: start it with moerl's Mooncake connector")
    r = client(FakeEngineClient(error=error)).post("/v1/completions", json={})
    assert r.status_code == 200 and r.json() == {"choices": [{"text": "x"}]}
    assert r.headers[HEADER] == f"error: RuntimeError: {error}"


def test_failed_generations_and_other_routes_are_not_held():
    engine = FakeEngineClient()
    r = client(engine, status=400).post("/v1/completions", json={})
    assert r.status_code == 400 and HEADER not in r.headers
    r = client(engine).post("/pause", json={})
    assert r.status_code == 200 and HEADER not in r.headers
    assert engine.calls == []
