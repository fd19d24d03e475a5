"""The plugin's swap route (vllm_ext.weights.swap): pause, apply, finish and resume in one request, the
replica resumed whatever fails, bad bodies refused. FakeAsyncLLM stands in for vLLM's engine client
(the route on real servers: tests/integration/test_weight_sync.py's sharded updates)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_ext.metrics import state
from vllm_ext.weights import swap


class FakeAsyncLLM:
    """Records the calls the route makes; `fail` names the one that raises."""

    def __init__(self, fail: str = ""):
        self.calls: list[tuple] = []
        self.fail = fail
        self.engine_core = self.renderer = self

    def _call(self, *call) -> None:
        self.calls.append(call)
        if call[0] == self.fail:
            raise RuntimeError(f"{self.fail} broke")

    async def clear_mm_cache_async(self) -> None:
        self._call("clear_mm_cache")

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        self._call("pause", mode, clear_cache)

    async def update_weights(self, request) -> None:
        self._call("update", request.update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", weight_version)

    async def resume_generation(self) -> None:
        self._call("resume")
        state.set(paused=False)


@pytest.fixture
def client():
    app = FastAPI()
    app.include_router(swap.router())  # what vllm_ext.routes adds beside vLLM's RL routes

    def make(engine: FakeAsyncLLM) -> TestClient:
        app.state.engine_client = engine
        return TestClient(app)

    return make


INFO = {"transport": "sharded", "version": 4, "phase": "apply", "workers": [[]]}


def test_one_request_pauses_applies_finishes_and_resumes(client):
    engine = FakeAsyncLLM()
    r = client(engine).post(swap.ROUTE, json={"update_info": INFO, "weight_version": "4"})
    assert r.status_code == 200, r.text
    # the pause clears the caches, as vLLM's /pause does: no prefix computed by the old weights is reused
    assert engine.calls == [("clear_mm_cache",), ("pause", "keep", True), ("update", INFO), ("finish", "4"),
                            ("resume",)]
    assert set(r.json()) == {"pause_s", "update_s", "finish_s", "resume_s"}


@pytest.mark.parametrize("fail", ["update", "finish"])
def test_a_failed_step_answers_500_after_the_resume(client, fail):
    engine = FakeAsyncLLM(fail)
    r = client(engine).post(swap.ROUTE, json={"update_info": INFO, "weight_version": "4"})
    assert r.status_code == 500 and r.json()["error"]["message"] == f"RuntimeError: {fail} broke"
    done = [c[0] for c in engine.calls]
    assert done == ["clear_mm_cache", "pause", "update"] + (["finish"] if fail == "finish" else []) + ["resume"]
    assert state.paused is False


@pytest.mark.parametrize("body", [{"update_info": INFO}, {"update_info": [INFO], "weight_version": "4"},
                                  {"update_info": INFO, "weight_version": 4}, ["not", "an", "object"]])
def test_a_malformed_body_is_refused_before_the_pause(client, body):
    engine = FakeAsyncLLM()
    r = client(engine).post(swap.ROUTE, json=body)
    assert r.status_code == 400 and "expected {\"update_info\"" in r.json()["error"]["message"]
    assert engine.calls == []
