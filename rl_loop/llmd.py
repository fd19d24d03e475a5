"""`moerl rl` routing through a running llm-d endpoint picker (EPP), over Envoy's ext_proc protocol.

Behind a gateway, Envoy asks the EPP where each request goes. `moerl rl` sends its
requests straight to the replicas, so it asks the EPP itself, the way Envoy does: one
`envoy.service.ext_proc.v3.ExternalProcessor/Process` stream per request carrying the
request headers (with the GRPO group / session id in `x-moerl-affinity-key`) and body;
the EPP answers with the `x-gateway-destination-endpoint` header (`ip:port` of the
replica its profile picked). With llm-d's prefill/decode profiles (`disagg-profile-handler`,
`moerl router-config --prefill-endpoints`) the destination is a decode replica, and when the
profile's decider wants the prompt prefilled elsewhere `x-prefiller-host-port` names the prefill
replica: `moerl rl` then makes the two hops llm-d's pd-sidecar would (`rl_loop.disagg`).
After the replica answered, the response headers and body go down the same stream, so the
EPP sees the request end as it would behind Envoy.

When the EPP finds no endpoint (every replica paused for a weight update) it answers at
once with HTTP 429; the router then backs off (exponentially, up to `max_backoff_s`)
and asks again until `retry_for_s` has passed, counting each wait.

Only the handful of protobuf fields this exchange uses are encoded here (field numbers
of envoy/service/ext_proc/v3/external_processor.proto and envoy/config/core/v3/base.proto),
so no generated Envoy stubs are needed: grpcio carries the raw bytes.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator
from urllib.parse import urlsplit

import grpc

from .replicas import Replica
from .report import log
from .router import Route

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILL_HEADER = "x-prefiller-host-port"  # llm-d's disagg-profile-handler: the prefill profile's pick
AFFINITY_HEADER = "x-moerl-affinity-key"


# --------------------------------------------------------------------------- protobuf subset


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    """A length-delimited (bytes) or varint (int) field."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _fields(buf: bytes) -> list[tuple[int, bytes | int]]:
    """(field number, value) of every field of one message; length-delimited values as bytes."""
    out, i = [], 0

    def varint() -> int:
        nonlocal i
        n = shift = 0
        while True:
            b = buf[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    while i < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 2:
            n = varint()
            out.append((number, buf[i:i + n]))
            i += n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            out.append((number, buf[i:i + size]))
            i += size
        else:
            raise ValueError(f"ext_proc: unsupported protobuf wire type {wire}")
    return out


def _first(buf: bytes, number: int, default=None):
    return next((v for n, v in _fields(buf) if n == number), default)


def _header_map(headers: dict[str, str]) -> bytes:
    # HeaderMap{headers: [HeaderValue{key=1, raw_value=3}]} (Envoy fills raw_value)
    return b"".join(_field(1, _field(1, k.encode()) + _field(3, v.encode())) for k, v in headers.items())


def request_headers_message(headers: dict[str, str]) -> bytes:
    """ProcessingRequest{request_headers=2: HttpHeaders{headers=1, end_of_stream=3: false}}."""
    return _field(2, _field(1, _header_map(headers)))


def body_message(body: bytes, *, response: bool = False) -> bytes:
    """ProcessingRequest{request_body=4 | response_body=5: HttpBody{body=1, end_of_stream=2: true}}."""
    return _field(5 if response else 4, _field(1, body) + _field(2, 1))


def response_headers_message(headers: dict[str, str]) -> bytes:
    """ProcessingRequest{response_headers=3: HttpHeaders{headers=1}}."""
    return _field(3, _field(1, _header_map(headers)))


@dataclass(frozen=True)
class Answer:
    """One ProcessingResponse: which phase it answers, headers it sets, or an immediate HTTP answer."""

    phase: str  # request_headers, request_body, response_headers, response_body, immediate, other
    set_headers: dict[str, str] = field(default_factory=dict)
    status: int = 0  # immediate responses only
    details: str = ""


_PHASES = {1: "request_headers", 2: "response_headers", 3: "request_body", 4: "response_body", 7: "immediate"}


def _header_value(hv: bytes) -> tuple[str, str]:
    f = dict(_fields(hv))
    value = f.get(3) or f.get(2) or b""
    return f.get(1, b"").decode(), value.decode(errors="replace")


def _mutation_headers(mutation: bytes) -> dict[str, str]:
    # HeaderMutation{set_headers=1: [HeaderValueOption{header=1: HeaderValue}]}
    return dict(_header_value(_first(opt, 1, b"")) for n, opt in _fields(mutation) if n == 1)


def parse_answer(buf: bytes) -> Answer:
    """Decode a ProcessingResponse as far as routing needs."""
    for number, value in _fields(buf):
        phase = _PHASES.get(number)
        if phase is None:
            continue
        if phase == "immediate":  # ImmediateResponse{status=1: HttpStatus{code=1}, body=3, details=5}
            code = _first(_first(value, 1, b""), 1, 0)
            body = _first(value, 3, b"")
            details = _first(value, 5, b"")
            return Answer("immediate", status=int(code), details=(details or body).decode(errors="replace"))
        # HeadersResponse/BodyResponse{response=1: CommonResponse{header_mutation=2}}
        common = _first(value, 1, b"")
        return Answer(phase, _mutation_headers(_first(common, 2, b"")))
    return Answer("other")


# --------------------------------------------------------------------------- routing


class PickerUnavailable(RuntimeError):
    """The EPP could not be asked (not running, wrong address): not the replicas' fault, so no fail-over."""


class PickerRejected(RuntimeError):
    """The EPP answered the request itself (no endpoint) and kept doing so for `retry_for_s`."""

    def __init__(self, status: int, details: str):
        super().__init__(f"llm-d EPP answered HTTP {status}: {details[:300]}")
        self.status = status


@dataclass
class LlmdRouter:
    """Routes each request through a running EPP at `address` (`host:port` of its ext_proc gRPC port)."""

    address: str
    retry_for_s: float = 120.0
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    authority: str = "moerl"
    picks_prefill = True  # with P/D profiles in the EPP's config; without them it never names one
    backoffs: int = 0  # waits after a 429/503 answer, over the router's life
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)

    def _stream(self):
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        call = self._channel.stream_stream(PROCESS_METHOD, request_serializer=None, response_deserializer=None)
        return call()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _headers(self, path: str, key: str, body: bytes) -> dict[str, str]:
        return {":method": "POST", ":path": path, ":authority": self.authority, ":scheme": "http",
                "content-type": "application/json", "content-length": str(len(body)), AFFINITY_HEADER: key}

    async def _ask(self, stream, path: str, key: str, body: bytes) -> Answer:
        """Send headers + body; the EPP's decision (the request-headers answer) or its immediate answer."""
        await stream.write(request_headers_message(self._headers(path, key, body)))
        await stream.write(body_message(body))
        while True:
            raw = await stream.read()
            if raw is grpc.aio.EOF:
                raise PickerUnavailable(f"llm-d EPP at {self.address} closed the stream without an answer")
            answer = parse_answer(raw)
            if answer.phase in ("request_headers", "immediate"):
                return answer

    @asynccontextmanager
    async def route(self, candidates: list[Replica], key: str, body: dict,
                    path: str = "/v1/completions") -> AsyncIterator[Route]:
        """The replica the EPP picks for `body`; backs off and asks again while it answers 429/503."""
        raw = json.dumps(body).encode()
        deadline = time.monotonic() + self.retry_for_s
        wait = self.backoff_s
        while True:
            stream = self._stream()
            try:
                answer = await self._ask(stream, path, key, raw)
            except grpc.aio.AioRpcError as e:
                stream.cancel()
                raise PickerUnavailable(f"llm-d EPP at {self.address}: {e.code().name}: {e.details()} (is moerl-epp "
                                        f"running with --grpc-port {self.address.rpartition(':')[2]}?)") from None
            except BaseException:
                stream.cancel()
                raise
            if answer.phase == "request_headers":
                break
            stream.cancel()
            if answer.status not in (429, 503) or time.monotonic() + wait > deadline:
                raise PickerRejected(answer.status, answer.details)
            self.backoffs += 1
            log(f"llm-d EPP answered {answer.status} for {key} ({answer.details[:120]}); retrying in {wait:.2f}s")
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.max_backoff_s)
        destination = answer.set_headers.get(DESTINATION_HEADER, "")
        prefill = answer.set_headers.get(PREFILL_HEADER)
        route = Route(_replica_at(candidates, destination), _replica_at(candidates, prefill) if prefill else None)
        try:
            yield route
        finally:
            await self._finish(stream, route)

    async def _finish(self, stream, route: Route) -> None:
        """Report the replica's answer down the stream (as Envoy does), then end it."""
        try:
            if route.status:
                await stream.write(response_headers_message({":status": str(route.status),
                                                             "content-type": "application/json"}))
                await stream.write(body_message(route.body, response=True))
                await stream.done_writing()
                while await asyncio.wait_for(stream.read(), 10.0) is not grpc.aio.EOF:
                    pass
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            pass  # the decision was already taken; a stream torn down afterwards changes nothing
        finally:
            stream.cancel()


def _replica_at(candidates: list[Replica], destination: str) -> Replica:
    for r in candidates:
        u = urlsplit(r.base_url)
        if f"{u.hostname}:{u.port}" == destination:
            return r
    raise RuntimeError(f"llm-d EPP picked {destination or 'no endpoint'}, which is not one of inference.endpoints "
                       f"({', '.join(r.base_url for r in candidates)}); write the EPP's endpoints with "
                       f"`moerl router-config --endpoints` for the same replicas")
