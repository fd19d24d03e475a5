"""Rollouts: send groups to the inference replicas and collect tokens, logprobs and routing.

A GRPO group is one `/v1/completions` request with `n` samples, so the whole
group lands on one replica and shares its prompt's KV cache. Prompts and
completions travel as token ids (token-in/token-out), so the trainer sees
exactly the tokens the engine sampled. When a replica fails mid-request the
group is re-sent to another replica and counted; it is never silently lost.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import numpy as np

from vllm_ext.routing.record import decode_record_b64

from .replicas import Replica


@dataclass
class Completion:
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    routing: np.ndarray | None


class GroupFailed(RuntimeError):
    """No replica could generate the group."""


def parse_choice(choice: dict) -> Completion:
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    ids = [int(t.split(":", 1)[1]) for t in tokens]
    routing = None
    if choice.get("routed_experts"):
        record = decode_record_b64(choice["routed_experts"])
        if record.start != 0:
            raise ValueError(f"routing record starts at position {record.start}, expected 0")
        routing = record.expert_ids
    return Completion(ids, [float(x) for x in lp.get("token_logprobs") or []], choice.get("text", ""), routing)


async def request_group(session: aiohttp.ClientSession, replica: Replica, model: str, prompt_ids: list[int], *,
                        n: int, max_tokens: int, temperature: float, seed: int, timeout_s: float) -> list[Completion]:
    body = {
        "model": model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens, "temperature": temperature,
        "logprobs": 0, "return_tokens_as_token_ids": True, "seed": seed, "ignore_eos": True,
    }
    replica.in_flight += 1
    try:
        async with session.post(replica.base_url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
            data = await resp.json()
    finally:
        replica.in_flight -= 1
    return [parse_choice(c) for c in sorted(data["choices"], key=lambda c: c["index"])]


async def generate_group(session: aiohttp.ClientSession, replicas: list[Replica], pick, model: str,
                         prompt_ids: list[int], key: str, counters: dict, **kw) -> tuple[list[Completion], Replica]:
    """Generate one group on the replica `pick(replicas, key)` chooses; on failure mark it down and re-send."""
    tried: set[str] = set()
    while True:
        candidates = [r for r in replicas if r.up and r.name not in tried]
        if not candidates:
            raise GroupFailed(f"group {key}: every replica failed ({sorted(tried)})")
        replica = pick(candidates, key)
        try:
            return await request_group(session, replica, model, prompt_ids, **kw), replica
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            # Unreachable or dead: take it out of rotation (an HTTP error answer propagates instead).
            replica.up = False
            tried.add(replica.name)
            counters["resent_groups"] = counters.get("resent_groups", 0) + 1
