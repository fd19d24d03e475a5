"""`POST /moerl/kv_pool/flush` (vllm_ext.routes): answered once the worker's puts are stored, 504 when
they are not by the timeout, the worker's message when it pools no KV, bad bodies refused.
FakeEngineClient stands in for vLLM's engine client (the route on real servers, between a prefill
and a decode replica: tests/integration/test_kv_pool.py)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_ext import routes


class FakeEngineClient:
    """Answers `collective_rpc` with one result per worker, or raises `error`."""

    def __init__(self, results=(True,), error: Exception | None = None):
        self.results, self.error = list(results), error
        self.calls: list[tuple] = []

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        if self.error:
            raise self.error
        return self.results


def client(engine: FakeEngineClient) -> TestClient:
    app = FastAPI()
    app.include_router(routes._flush_router())  # noqa: SLF001 - what the route patch adds beside vLLM's RL routes
    app.state.engine_client = engine
    return TestClient(app)


def test_flush_waits_on_every_worker_with_the_timeout_asked():
    engine = FakeEngineClient([True, True])
    r = client(engine).post(routes.FLUSH_ROUTE, json={"timeout_s": 5})
    assert r.status_code == 200 and r.json()["seconds"] >= 0
    assert engine.calls == [("moerl_flush_kv_pool", (5,))]
    client(engine).post(routes.FLUSH_ROUTE)
    assert engine.calls[-1] == ("moerl_flush_kv_pool", (routes.FLUSH_TIMEOUT_S,))


def test_puts_still_pending_are_a_504():
    r = client(FakeEngineClient([True, False])).post(routes.FLUSH_ROUTE, json={"timeout_s": 1})
    assert r.status_code == 504 and r.json()["error"]["message"] == "KV pool puts still pending after 1 s"


def test_a_replica_without_the_pool_answers_the_workers_message():
    error = RuntimeError("this replica pools no KV: start it with moerl's Mooncake connector")
    r = client(FakeEngineClient(error=error)).post(routes.FLUSH_ROUTE)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == f"RuntimeError: {error}"


@pytest.mark.parametrize("body", [b"{", b'{"timeout_s": 0}', b'{"timeout_s": "5"}', b'{"timeout_s": true}', b"[1]"])
def test_bad_bodies_are_refused_before_the_engine_is_asked(body):
    engine = FakeEngineClient()
    r = client(engine).post(routes.FLUSH_ROUTE, content=body)
    assert r.status_code == 400 and routes.FLUSH_ROUTE in r.json()["error"]["message"]
    assert engine.calls == []
