"""Prefill/decode disaggregation over the Mooncake KV pool, with the routing record intact.

With `inference.prefill_replicas` = P and `decode_replicas` = D, `moerl rl` starts P prefill
replicas (p0, ...) and D decode replicas (d0, ...), every one pooling KV with its routing rows
in one Mooncake store (`vllm_ext.kv_pool`). Each request then runs in two halves:

1. prefill: the prompt, `max_tokens` 1, on a prefill replica: the one the embedded router picks
   for the group's key, or the one llm-d's prefill profile picked (`rl_loop.llmd`; its decider
   may also find the prompt cached on the decode replica and name none). The replica answers once
   its KV blocks and their routing rows are in the store (`vllm_ext.prefill_handoff`, the
   middleware `rl_loop.kv_pool` starts prefill replicas with);
2. decode: the request as configured on a decode replica. vLLM's Mooncake connector finds the
   prompt's complete blocks in the pool (moerl's lookup only where their routing rows are there
   too), loads KV and rows, computes the rest of the prompt and samples. The response carries
   one record over prompt and sampled tokens, the pooled rows where the prefill replica
   computed them: the record a single replica would give (`tests/integration/test_kv_pool.py`).

Multi-turn conversations need nothing more: turn n+1's prefill finds turn n's blocks in the pool
(the decode replica pooled them) and computes only the new ones.

Nothing here can make a record wrong; at worst the decode replica computes more itself. A
prefill replica that fails is taken out of rotation and the prompt is prefilled on the next one
(`prefill_resent`; under llm-d the decode replica computes it, and the picker, which scrapes
the replicas, stops choosing the dead one); with none left, or a hand-over that times out (the
store slow or gone), the decode replica computes what the pool lacks (`prefill_skipped`,
`flush_timeouts`). Policy versions keep KV of old weights from new ones: pool keys carry the
version of the weights that computed them, and a weight update moves prefill and decode
replicas together (they are all replicas of the run).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from vllm_ext.prefill_handoff import FLUSH_TIMEOUT_S, HEADER

from .kv_pool import PREFILL_MIDDLEWARE
from .replicas import Replica
from .report import log
from .router import Router


def replica_roles(c) -> list[tuple[str, str]]:
    """(name, role) of each managed replica of `c` (an InferenceConfig), in port order."""
    if not c.prefill_replicas:
        return [(f"r{i}", "both") for i in range(c.replicas)]
    return ([(f"p{i}", "prefill") for i in range(c.prefill_replicas)]
            + [(f"d{i}", "decode") for i in range(c.decode_replicas)])


def disagg_metrics(counters: dict) -> dict:
    """A step's prefill/decode figures for metrics.jsonl: prompts prefilled, their mean time (until
    their KV was pooled), and the fall-backs."""
    n = counters.get("prefills", 0)
    return {"prefills": n, "prefill_s_mean": round(counters.get("prefill_s", 0.0) / n, 4) if n else None,
            **{k: counters.get(k, 0) for k in ("prefill_resent", "prefill_skipped", "flush_timeouts")}}


def prefill_replicas(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.role == "prefill"]


def serving_replicas(replicas: list[Replica]) -> list[Replica]:
    """The replicas that sample (all of them without disaggregation)."""
    return [r for r in replicas if r.role != "prefill"]


async def prefill_on(session: aiohttp.ClientSession, replica: Replica, body: dict, key: str, counters: dict,
                     timeout_s: float) -> bool:
    """`body`'s prompt computed on the prefill `replica` and held there until its KV is in the pool
    (`vllm_ext.prefill_handoff`). False, with the replica out of rotation, when it could not."""
    half = {**body, "n": 1, "max_tokens": 1, "logprobs": None, "routed_experts_prompt_start": len(body["prompt"])}
    t0 = time.perf_counter()
    replica.in_flight += 1
    try:
        async with session.post(replica.base_url + "/v1/completions", json=half,
                                timeout=aiohttp.ClientTimeout(total=timeout_s + FLUSH_TIMEOUT_S)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw.decode(errors='replace')[:500]}")
            pooled = resp.headers.get(HEADER, "")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log(f"prefill replica {replica.name} failed on group {key} ({exc!r}): out of rotation")
        replica.up = False
        return False
    finally:
        replica.in_flight -= 1
    if not pooled.startswith("stored"):
        if not pooled:
            raise RuntimeError(f"prefill replica {replica.name} answered without {HEADER}: it does not hand its KV "
                               f"to the pool; start it with --middleware {PREFILL_MIDDLEWARE} (rl_loop.kv_pool)")
        counters["flush_timeouts"] = counters.get("flush_timeouts", 0) + 1
    counters["prefill_s"] = counters.get("prefill_s", 0.0) + time.perf_counter() - t0
    counters["prefills"] = counters.get("prefills", 0) + 1
    return True


async def prefill(session: aiohttp.ClientSession, replicas: list[Replica], router: Router, body: dict, key: str,
                  counters: dict, timeout_s: float) -> Replica | None:
    """The first half of a disaggregated request under a router that does not pick the prefill replica
    (the embedded one): a prefill replica `router` picks for `key`, the next one when it fails.
    Returns the replica, or None when none could (counted)."""
    tried: set[str] = set()
    while True:
        candidates = [r for r in prefill_replicas(replicas) if r.up and r.name not in tried]
        if not candidates:
            counters["prefill_skipped"] = counters.get("prefill_skipped", 0) + 1
            return None
        async with router.route(candidates, key, body) as route:
            if await prefill_on(session, route.replica, body, key, counters, timeout_s):
                return route.replica
            tried.add(route.replica.name)
            counters["prefill_resent"] = counters.get("prefill_resent", 0) + 1
