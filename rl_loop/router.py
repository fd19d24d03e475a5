"""Routers of `moerl rl`: where each group (or multi-turn session) goes.

On one machine there is no llm-d; the embedded router (`embedded_pick`) asks
router_ext's scorer, the same formula the llm-d plugin runs, fed with what the
orchestrator knows first-hand: requests in flight per replica, its policy version
and whether it is updating. Groups stick to a replica (bounded consistent hashing
on the group key) while load allows. With `inference.router = "llmd"` a running
llm-d endpoint picker decides instead (`rl_loop.llmd`).

A router is anything with `route(candidates, key, body)`: an async context manager
yielding the `Route` (the replica) for one request, open while the request runs. Under
prefill/decode disaggregation a router that `picks_prefill` (llm-d's P/D profiles) also names
the prefill replica in the route; for one that does not, `rl_loop.disagg` picks it with a
route of its own among the prefill replicas.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncContextManager, Callable, Protocol

from router_ext.scorer import EndpointSignals, RequestInfo, ScorerParams, score

from .replicas import Replica


@dataclass
class Route:
    """Where one request goes (and, when the router chose one, where its prompt is prefilled);
    `answered` keeps the replica's reply for routers that report it (llm-d)."""

    replica: Replica
    prefill: Replica | None = None
    status: int = 0
    body: bytes = b""

    def answered(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body


class Router(Protocol):
    picks_prefill: bool

    def route(self, candidates: list[Replica], key: str, body: dict) -> AsyncContextManager[Route]: ...


@dataclass
class PickRouter:
    """A router from a choice function `(replicas, key) -> Replica`, such as `embedded_pick`."""

    pick: Callable[[list[Replica], str], Replica]
    picks_prefill = False

    @asynccontextmanager
    async def route(self, candidates: list[Replica], key: str, body: dict):
        yield Route(self.pick(candidates, key))


def as_router(pick) -> Router:
    return pick if hasattr(pick, "route") else PickRouter(pick)


def embedded_pick(replicas: list[Replica], key: str, params: ScorerParams = ScorerParams()) -> Replica:
    signals = [
        EndpointSignals(name=r.name, in_flight=r.in_flight, policy_version=r.policy_version, updating=r.updating)
        for r in replicas
    ]
    result = score(signals, RequestInfo(affinity_key=key), params)
    if result.pick is None:
        raise RuntimeError("no replica can take the request (all paused or down)")
    return replicas[result.pick]
