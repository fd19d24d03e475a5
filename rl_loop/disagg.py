"""Prefill/decode disaggregation over the Mooncake KV pool, with the routing record intact.

With `inference.prefill_replicas` = P and `decode_replicas` = D, `moerl rl` starts P prefill
replicas (p0, ...) and D decode replicas (d0, ...), every one pooling KV with its routing rows
in one Mooncake store (`vllm_ext.kv_pool`). Each request then runs in two halves:

1. prefill: the prompt, `max_tokens` 1, on the prefill replica the router picks for the group's
   key; then `POST /moerl/kv_pool/flush` on it (`vllm_ext.routes`), which answers once its KV
   blocks and their routing rows are in the store (a response leaves before its step's puts);
2. decode: the request as configured on a decode replica. vLLM's Mooncake connector finds the
   prompt's complete blocks in the pool (moerl's lookup only where their routing rows are there
   too), loads KV and rows, computes the rest of the prompt and samples. The response carries
   one record over prompt and sampled tokens, the pooled rows where the prefill replica
   computed them: the record a single replica would give (`tests/integration/test_kv_pool.py`).

Multi-turn conversations need nothing more: turn n+1's prefill finds turn n's blocks in the pool
(the decode replica pooled them) and computes only the new ones.

Nothing here can make a record wrong; at worst the decode replica computes more itself. A
prefill replica that fails is taken out of rotation and the prompt is prefilled on the next one
(`prefill_resent`); with none left, or a flush that times out (the store slow or gone), the
decode replica computes what the pool lacks (`prefill_skipped`, `flush_timeouts`). Policy
versions keep KV of old weights from new ones: pool keys carry the version of the weights that
computed them, and a weight update moves prefill and decode replicas together (they are all
replicas of the run).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from vllm_ext.routes import FLUSH_ROUTE

from .replicas import Replica
from .report import log
from .router import as_router

FLUSH_TIMEOUT_S = 30.0


def replica_roles(c) -> list[tuple[str, str]]:
    """(name, role) of each managed replica of `c` (an InferenceConfig), in port order."""
    if not c.prefill_replicas:
        return [(f"r{i}", "both") for i in range(c.replicas)]
    return ([(f"p{i}", "prefill") for i in range(c.prefill_replicas)]
            + [(f"d{i}", "decode") for i in range(c.decode_replicas)])


def disagg_metrics(counters: dict) -> dict:
    """A step's prefill/decode figures for metrics.jsonl: prompts prefilled, their mean time (prefill
    and flush), and the fall-backs."""
    n = counters.get("prefills", 0)
    return {"prefills": n, "prefill_s_mean": round(counters.get("prefill_s", 0.0) / n, 4) if n else None,
            **{k: counters.get(k, 0) for k in ("prefill_resent", "prefill_skipped", "flush_timeouts")}}


def prefill_replicas(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.role == "prefill"]


def serving_replicas(replicas: list[Replica]) -> list[Replica]:
    """The replicas that sample (all of them without disaggregation)."""
    return [r for r in replicas if r.role != "prefill"]


async def prefill(session: aiohttp.ClientSession, replicas: list[Replica], pick, body: dict, key: str,
                  counters: dict, timeout_s: float) -> Replica | None:
    """The first half of a disaggregated request: `body`'s prompt computed on a prefill replica and
    flushed into the pool. Returns the replica, or None when no prefill replica could (counted)."""
    router = as_router(pick)
    half = {**body, "n": 1, "max_tokens": 1, "logprobs": None, "routed_experts_prompt_start": len(body["prompt"])}
    t0 = time.perf_counter()
    tried: set[str] = set()
    while True:
        candidates = [r for r in prefill_replicas(replicas) if r.up and r.name not in tried]
        if not candidates:
            counters["prefill_skipped"] = counters.get("prefill_skipped", 0) + 1
            return None
        async with router.route(candidates, key, half) as route:
            replica = route.replica
            replica.in_flight += 1
            try:
                async with session.post(replica.base_url + "/v1/completions", json=half,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    raw = await resp.read()
                    route.answered(resp.status, raw)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {raw.decode(errors='replace')[:500]}")
                async with session.post(replica.base_url + FLUSH_ROUTE, json={"timeout_s": FLUSH_TIMEOUT_S},
                                        timeout=aiohttp.ClientTimeout(total=FLUSH_TIMEOUT_S + 10)) as resp:
                    if resp.status == 504:
                        counters["flush_timeouts"] = counters.get("flush_timeouts", 0) + 1
                    elif resp.status != 200:
                        raise RuntimeError(f"{FLUSH_ROUTE}: HTTP {resp.status}: {(await resp.text())[:500]}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log(f"prefill replica {replica.name} failed on group {key} ({exc!r}): out of rotation, prompt "
                    "prefilled elsewhere")
                replica.up = False
                tried.add(replica.name)
                counters["prefill_resent"] = counters.get("prefill_resent", 0) + 1
                continue
            finally:
                replica.in_flight -= 1
        counters["prefill_s"] = counters.get("prefill_s", 0.0) + time.perf_counter() - t0
        counters["prefills"] = counters.get("prefills", 0) + 1
        return replica
