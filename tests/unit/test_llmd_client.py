"""rl_loop.llmd: the ext_proc messages moerl rl exchanges with the llm-d endpoint picker.

The expected bytes were produced by Envoy's own Go protobuf types
(github.com/envoyproxy/go-control-plane/envoy v1.37.0, deterministic marshalling) for
the same messages, so the hand-written encoder and decoder agree with the real schema
even where the end-to-end test (tests/integration/test_llmd_epp.py) does not run.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from rl_loop.config import ConfigError, RLConfig
from rl_loop.llmd import (DESTINATION_HEADER, _replica_at, body_message, parse_answer, request_headers_message,
                          response_headers_message)
from rl_loop.replicas import Replica
from rl_loop.rollouts import generate_group
from rl_loop.router import Route

GO = {
    "headers_response": "0a520a50124c0a320a300a1e782d676174657761792d64657374696e6174696f6e2d656e64706f696e741a0e3132"
                        "372e302e302e313a383030310a160a140a0e436f6e74656e742d4c656e6774681a0234322801",
    "immediate_429": "3a4c0a0308ad031a45696e666572656e636520676174657761793a205265736f757263654578686175737465642"
                     "02d206661696c656420746f2066696e642074617267657420656e64706f696e74",
    "request_headers": "12380a360a180a053a706174681a0f2f76312f636f6d706c6574696f6e730a1a0a14782d6d6f65726c2d616666"
                       "696e6974792d6b65791a026731",
    "request_body": "220b0a077b2261223a317d1001",
    "response_body": "2a060a027b7d1001",
    "response_headers": "1a120a100a0e0a073a7374617475731a03323030",
}


def test_requests_are_encoded_as_envoy_encodes_them():
    headers = {":path": "/v1/completions", "x-moerl-affinity-key": "g1"}
    assert request_headers_message(headers).hex() == GO["request_headers"]
    assert body_message(b'{"a":1}').hex() == GO["request_body"]
    assert response_headers_message({":status": "200"}).hex() == GO["response_headers"]
    assert body_message(b"{}", response=True).hex() == GO["response_body"]


def test_the_pickers_decision_and_its_429_are_decoded():
    decision = parse_answer(bytes.fromhex(GO["headers_response"]))
    assert decision.phase == "request_headers"
    assert decision.set_headers == {DESTINATION_HEADER: "127.0.0.1:8001", "Content-Length": "42"}
    refused = parse_answer(bytes.fromhex(GO["immediate_429"]))
    assert (refused.phase, refused.status) == ("immediate", 429)
    assert "failed to find target endpoint" in refused.details


def test_a_pick_outside_the_configured_endpoints_is_one_clear_error():
    replicas = [Replica("r0", "http://127.0.0.1:8001"), Replica("r1", "http://127.0.0.1:8002")]
    assert _replica_at(replicas, "127.0.0.1:8002").name == "r1"
    with pytest.raises(RuntimeError, match="picked 10.0.0.9:8000, which is not one of inference.endpoints"):
        _replica_at(replicas, "10.0.0.9:8000")


def test_the_llmd_router_knobs(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text('[inference]\nrouter = "llmd"\nllmd_address = "10.0.0.5:9002"\n')
    cfg = RLConfig.from_toml(path)
    assert (cfg.inference.router, cfg.inference.llmd_address) == ("llmd", "10.0.0.5:9002")
    with pytest.raises(ConfigError, match="inference.llmd_address"):
        RLConfig.from_toml(path, {"inference.llmd_address": "http://10.0.0.5"})
    with pytest.raises(ConfigError, match="inference.router"):
        RLConfig.from_toml(path, {"inference.router": "envoy"})


def test_an_unreachable_picker_is_one_clear_error_and_no_replica_is_blamed():
    import asyncio
    import socket

    import aiohttp

    from rl_loop.llmd import LlmdRouter, PickerUnavailable
    from rl_loop.rollouts import generate_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    replica = Replica("r0", "http://127.0.0.1:8001")

    async def run():
        router = LlmdRouter(f"127.0.0.1:{port}")
        try:
            async with aiohttp.ClientSession() as session:
                await generate_group(session, [replica], router, "m", [1, 2], "g", {}, n=1, max_tokens=1,
                                     temperature=1.0, seed=0, timeout_s=5.0)
        finally:
            await router.close()

    with pytest.raises(PickerUnavailable, match=f"llm-d EPP at 127.0.0.1:{port}: UNAVAILABLE"):
        asyncio.run(run())
    assert replica.up


class FakePdPicker:
    """Stands in for llm-d's P/D profiles: routes every request to `destination` (by name) and records
    the candidates it was offered."""

    picks_prefill = True

    def __init__(self, destination: str):
        self.destination, self.offered = destination, []

    @asynccontextmanager
    async def route(self, candidates, key, body):
        self.offered.append(sorted(r.name for r in candidates))
        yield Route(next(r for r in candidates if r.name == self.destination))


def test_a_picker_that_sends_a_group_to_a_prefill_replica_is_one_clear_error():
    replicas = [Replica("p0", "http://127.0.0.1:8001", role="prefill"), Replica("d0", "http://127.0.0.1:8002",
                                                                                 role="decode")]
    picker = FakePdPicker("p0")
    with pytest.raises(RuntimeError, match="to prefill replica p0 to sample: give llm-d's endpoints their roles"):
        asyncio.run(generate_group(None, replicas, picker, "m", [1, 2, 3], "g", {}, n=1, max_tokens=1,
                                   temperature=0.0, seed=0, timeout_s=1.0))
    assert picker.offered == [["d0", "p0"]]  # the picker chooses among every replica, by role
