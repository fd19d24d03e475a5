"""Rollouts: send groups to the inference replicas and collect tokens, logprobs and routing.

A GRPO group is one `/v1/completions` request with `n` samples, so the whole
group lands on one replica and shares its prompt's KV cache. Prompts and
completions travel as token ids (token-in/token-out), so the trainer sees
exactly the tokens the engine sampled. When a replica fails mid-request the
group is re-sent to another replica and counted; it is never silently lost.

Multi-turn rollouts (`Conversation`, `RolloutContext.turn`) keep one token
sequence per sample: each turn sends the whole sequence so far (prompt, earlier
completions, the environment's responses) as token ids and asks the server for
routing rows only from the first position it has not reported yet
(`routed_experts_prompt_start`), so the rows of all turns stitch into the record
one request over the final sequence would give. Environment tokens are kept with
loss-mask 0; only sampled tokens are trained on.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from vllm_ext.routing.record import decode_record_b64

from .batch import Sample
from .disagg import prefill, prefill_on, prefill_replicas, serving_replicas
from .replicas import Replica
from .report import log
from .router import Route, as_router


@dataclass
class Completion:
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    routing: np.ndarray | None  # rows from the request's routing start on
    finish_reason: str | None = None
    routing_error: str | None = None  # the server's "<reason>: <detail>" when it returned no routing
    index_keys: np.ndarray | None = None  # the DSA indexer's keys of the same rows, when the server captures them


class GroupFailed(RuntimeError):
    """No replica could generate the group."""


MALFORMED = "malformed_record"  # the reason of a record that does not decode (`rl_loop.batch.reason_kind`)


def parse_choice(choice: dict, routing_start: int = 0) -> Completion:
    """One `/v1/completions` choice; its routing record must start at `routing_start`. A record that
    does not decode (damaged, or indexer keys that do not fit their positions) leaves the completion
    without routing and says why, so the batch rejects that sample alone."""
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    ids = [int(t.split(":", 1)[1]) for t in tokens]
    routing = index_keys = None
    error = choice.get("routed_experts_error")
    if choice.get("routed_experts"):
        try:
            record = decode_record_b64(choice["routed_experts"])
        except ValueError as exc:
            error = f"{MALFORMED}: {exc}"
        else:
            if record.start != routing_start:
                raise ValueError(f"routing record starts at position {record.start}, expected {routing_start}")
            routing = record.expert_ids
            index_keys = None if record.index_keys is None else record.index_keys.keys
    return Completion(ids, [float(x) for x in lp.get("token_logprobs") or []], choice.get("text", ""), routing,
                      choice.get("finish_reason"), error, index_keys)


def completion_body(model: str, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, seed: int,
                    routing_start: int = 0, stop_token_ids: tuple[int, ...] = ()) -> dict:
    """The `/v1/completions` request of a group: token ids in and out, logprobs, routing from `routing_start`.
    The model's EOS never ends a sample; `stop_token_ids` (a chat template's end of turn) do, and stay in it."""
    body = {
        "model": model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens, "temperature": temperature,
        "logprobs": 0, "return_tokens_as_token_ids": True, "seed": seed, "ignore_eos": True,
    }
    if routing_start:
        body["routed_experts_prompt_start"] = routing_start
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    return body


# vLLM's API server closes an idle keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default);
# a client that reuses one the server has just closed gets "Server disconnected". Pooling for less than 5 s
# was not enough: a 30-step tools run on 2 cores still logged dozens of them (the orchestrator's loop, busy
# scoring, expired its pooled connections late), and a retry that met a second stale connection would take a
# healthy replica out of rotation. So every request opens its own connection: on the host or the LAN that
# costs well under a millisecond against requests of tens of milliseconds and more.


def replica_session() -> aiohttp.ClientSession:
    """The HTTP session for requests to the replicas (no pooled connections)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def request_group(session: aiohttp.ClientSession, replica: Replica, model: str, prompt_ids: list[int], *,
                        n: int, max_tokens: int, temperature: float, seed: int, timeout_s: float,
                        routing_start: int = 0, stop_token_ids: tuple[int, ...] = (),
                        route: Route | None = None) -> list[Completion]:
    """`n` completions of `prompt_ids` on `replica`; routing rows from position `routing_start` on.
    With `route`, the replica's answer is kept there for the router (the llm-d EPP hears how it ended)."""
    body = completion_body(model, prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed,
                           routing_start=routing_start, stop_token_ids=stop_token_ids)
    replica.in_flight += 1
    try:
        async with session.post(replica.base_url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if route is not None:
                route.answered(resp.status, raw)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw.decode(errors='replace')[:500]}")
            data = json.loads(raw)
    finally:
        replica.in_flight -= 1
    return [parse_choice(c, routing_start) for c in sorted(data["choices"], key=lambda c: c["index"])]


async def generate_group(session: aiohttp.ClientSession, replicas: list[Replica], pick, model: str,
                         prompt_ids: list[int], key: str, counters: dict, **kw) -> tuple[list[Completion], Replica]:
    """Generate one group on the replica the router `pick` chooses; on failure mark it down and re-send.

    `pick` is a `router.Router` (the llm-d EPP's client sees the request body) or a function
    `(replicas, key) -> Replica` (the embedded router). A transport error is retried once on the
    same replica before it counts as dead (a server that drops one connection is not yet dead).
    Among prefill and decode replicas the prompt is first computed on a prefill one (`disagg`): the one
    the router names with the route (llm-d's P/D profiles, which may also decide none is needed), or
    else one picked among the prefill replicas.
    """
    router = as_router(pick)
    body = completion_body(model, prompt_ids, **{k: v for k, v in kw.items() if k != "timeout_s"})
    disagg = bool(prefill_replicas(replicas))
    if disagg and not router.picks_prefill:
        await prefill(session, replicas, router, body, key, counters, kw["timeout_s"])
    tried: set[str] = set()
    while True:
        candidates = [r for r in serving_replicas(replicas) if r.up and r.name not in tried]
        if not candidates:
            raise GroupFailed(f"group {key}: every replica failed ({sorted(tried)})")
        if disagg and router.picks_prefill:  # llm-d's P/D profiles choose among every replica, by role
            candidates += [r for r in prefill_replicas(replicas) if r.up]
        async with router.route(candidates, key, body) as route:
            replica = route.replica
            if replica.role == "prefill":
                raise RuntimeError(f"the router sent group {key} to prefill replica {replica.name} to sample: give "
                                   "llm-d's endpoints their roles (moerl router-config --prefill-endpoints)")
            if route.prefill is not None and not await prefill_on(session, route.prefill, body, key, counters,
                                                                  kw["timeout_s"]):
                counters["prefill_skipped"] = counters.get("prefill_skipped", 0) + 1
            for attempt in (1, 2):
                try:
                    return await request_group(session, replica, model, prompt_ids, route=route, **kw), replica
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    # Unreachable or dead: take it out of rotation (an HTTP error answer propagates instead).
                    if attempt == 1 and not isinstance(exc, asyncio.TimeoutError) and replica.up:
                        log(f"replica {replica.name}: {exc!r} on group {key}; retrying once")
                        continue
                    log(f"replica {replica.name} failed on group {key} ({exc!r}): out of rotation, group re-sent")
                    replica.up = False
                    tried.add(replica.name)
                    counters["resent_groups"] = counters.get("resent_groups", 0) + 1


# ---------------------------------------------------------------------------
# multi-turn: one token sequence per sample, routing stitched across turns


class Conversation:
    """One multi-turn rollout as a single token sequence (token-in/token-out).

    `ids` is everything so far: the prompt, then, per turn, the environment's tokens
    (loss-mask 0: appended with `append`) and the model's sampled tokens (mask 1:
    `record`). Routing rows arrive per turn, each request asking only for the
    positions not reported before; `received` is how many leading positions have
    rows (every token but the last sampled one, after a turn).
    """

    def __init__(self, prompt_ids: list[int]):
        if not prompt_ids:
            raise ValueError("a conversation needs a non-empty prompt")
        self.prompt_ids = list(prompt_ids)
        self.ids = list(prompt_ids)
        self.mask: list[int] = []  # per token after the prompt: 1 sampled, 0 environment
        self.logprobs: list[float] = []  # per token after the prompt (0.0 for environment tokens)
        self.turns = 0
        self.received = 0
        self.rows_per_turn: list[int] = []  # routing rows each turn's response carried (only the new positions)
        self.policy_version: int | None = None
        self._rows: list[np.ndarray] = []
        self._keys: list[np.ndarray] | None = []  # indexer keys per turn; None once a turn came without
        self._routed = True
        self.routing_error: str | None = None  # the server's reason of the first turn that came without routing

    @property
    def completion_ids(self) -> list[int]:
        return self.ids[len(self.prompt_ids):]

    def append(self, ids: list[int]) -> None:
        """Environment tokens: part of the sequence (and of its routing), never trained on."""
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def record(self, comp: Completion, routing_start: int, policy_version: int) -> None:
        """Add one turn's sampled tokens and its routing rows [routing_start, len(ids) + new - 1)."""
        if routing_start != self.received:
            raise ValueError(f"turn asked for routing from position {routing_start}, "
                             f"but {self.received} positions have rows")
        if len(comp.logprobs) != len(comp.completion_ids):
            raise ValueError(f"{len(comp.logprobs)} logprobs for {len(comp.completion_ids)} sampled tokens")
        self.ids.extend(comp.completion_ids)
        self.mask.extend([1] * len(comp.completion_ids))
        self.logprobs.extend(comp.logprobs)
        self.turns += 1
        version = int(policy_version)
        self.policy_version = version if self.policy_version is None else min(self.policy_version, version)
        end = len(self.ids) - 1
        if comp.routing is None:
            if self._routed:
                self.routing_error = comp.routing_error
            self._routed = False
        elif self._routed:
            if comp.routing.shape[0] != end - routing_start:
                raise ValueError(f"turn {self.turns}: routing has {comp.routing.shape[0]} rows for positions "
                                 f"[{routing_start}, {end}) ({end - routing_start} expected)")
            self._rows.append(comp.routing)
            if comp.index_keys is None:
                self._keys = None
            elif self._keys is not None:
                self._keys.append(comp.index_keys)
        self.rows_per_turn.append(0 if comp.routing is None else int(comp.routing.shape[0]))
        self.received = end

    def routing(self) -> np.ndarray | None:
        """The stitched record `[len(ids) - 1, layers, top_k]`, or None if a turn came without routing."""
        if not self._routed or not self._rows:
            return None
        return np.concatenate(self._rows, axis=0)

    def index_keys(self) -> np.ndarray | None:
        """The stitched indexer keys (as `routing`), or None if a turn came without them."""
        if not self._routed or not self._rows or not self._keys:
            return None
        return np.concatenate(self._keys, axis=0)

    def sample(self, reward: float, group: int) -> Sample:
        return Sample(self.prompt_ids, self.completion_ids, list(self.logprobs), float(reward), group,
                      self.policy_version or 0, self.routing(), completion_mask=list(self.mask),
                      routing_error=self.routing_error, index_keys=self.index_keys())


@dataclass
class RolloutContext:
    """What a task needs to generate on the replicas: tokenizer, sampling settings, fail-over.

    Built once per step by the orchestrator (or by hand in tests); `complete` is one
    request (a group of `n` on one replica, re-sent on failure) and `turn` one model
    turn of a `Conversation`.
    """

    session: aiohttp.ClientSession
    replicas: list[Replica]
    pick: Any  # a router.Router, or the embedded router's (replicas, key) -> Replica
    model: str
    tokenizer: Any
    max_tokens: int
    temperature: float
    timeout_s: float
    counters: dict = field(default_factory=dict)

    async def complete(self, key: str, prompt_ids: list[int], *, seed: int, n: int = 1, routing_start: int = 0,
                       max_tokens: int | None = None,
                       stop_token_ids: tuple[int, ...] = ()) -> tuple[list[Completion], Replica]:
        return await generate_group(
            self.session, self.replicas, self.pick, self.model, prompt_ids, key, self.counters, n=n,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens, temperature=self.temperature,
            seed=seed, timeout_s=self.timeout_s, routing_start=routing_start, stop_token_ids=tuple(stop_token_ids))

    async def turn(self, conv: Conversation, key: str, seed: int, *, stop_token_ids: tuple[int, ...] = ()) -> Completion:
        """Sample the model's next turn on the whole sequence so far; only new routing rows are requested.
        `stop_token_ids` end the turn early (a tool-calling turn ends at the template's end of turn)."""
        start = conv.received
        (comp,), replica = await self.complete(key, conv.ids, seed=seed, routing_start=start,
                                               stop_token_ids=stop_token_ids)
        conv.record(comp, start, replica.policy_version)
        return comp

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Token ids of `text`: a prompt (`first`, with the tokenizer's special tokens) or a continuation."""
        return list(self.tokenizer(text, add_special_tokens=first).input_ids)
