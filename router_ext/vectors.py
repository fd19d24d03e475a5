"""Generate ``router_ext/testdata/vectors.json``, the Go/Python parity vectors.

Run ``python -m router_ext.vectors`` after changing the formula; the Go tests
(``go test ./...`` in ``router_ext/epp``) and ``tests/unit/test_router_vectors.py``
both replay the file. The expected values are produced by ``router_ext.scorer``,
so the file mostly guards *parity* (the Go port must agree to 1e-12 and pick the
same endpoint). To keep the Python side honest too, every hand-written scenario
carries its intended pick (written down here by hand, from the rule it
illustrates), and generation fails if the formula disagrees.

Integers that do not fit a JSON double (ring hashes) are written as decimal
strings.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path

from router_ext.scorer import (
    COMPONENTS,
    EndpointSignals,
    RequestInfo,
    ScorerParams,
    hash64,
    home_endpoint,
    prefix_match,
    score,
)

VECTORS_PATH = Path(__file__).parent / "testdata" / "vectors.json"

_JSON_NAMES = {
    "name": "name",
    "in_flight": "inFlight",
    "waiting": "waiting",
    "kv_usage": "kvUsage",
    "prefix_match": "prefixMatch",
    "policy_version": "policyVersion",
    "updating": "updating",
}


def endpoint_to_json(e: EndpointSignals) -> dict:
    """camelCase dict, the field names the Go test decodes."""
    return {_JSON_NAMES[k]: v for k, v in asdict(e).items()}


def endpoint_from_json(d: dict) -> EndpointSignals:
    """Inverse of :func:`endpoint_to_json`."""
    back = {v: k for k, v in _JSON_NAMES.items()}
    return EndpointSignals(**{back[k]: v for k, v in d.items()})


def _ep(name: str, **kw) -> EndpointSignals:
    return EndpointSignals(name=name, **kw)


def _hand_cases() -> list[tuple[str, ScorerParams, RequestInfo, list[EndpointSignals], str | None]]:
    """(name, params, request, endpoints, intended pick) written by hand."""
    p = ScorerParams()
    idle = [_ep(n, policy_version=3) for n in ("a", "b", "c", "d")]
    cases = [
        ("idle_no_key_ties_go_to_smallest_name", p, RequestInfo(), idle, "a"),
        (
            "paused_endpoint_never_picked_even_if_best",
            p,
            RequestInfo(),
            [
                _ep("a", in_flight=6, waiting=2, kv_usage=0.5, policy_version=3),
                _ep("b", prefix_match=1.0, policy_version=3, updating=True),
                _ep("c", in_flight=4, waiting=1, kv_usage=0.4, policy_version=3),
            ],
            "c",
        ),
        (
            "all_paused_picks_nothing",
            p,
            RequestInfo("g1"),
            [_ep("a", updating=True), _ep("b", updating=True)],
            None,
        ),
        (
            "stale_policy_version_loses",
            p,
            RequestInfo(),
            [_ep("a", policy_version=6), _ep("b", policy_version=7)],
            "b",
        ),
        (
            "lag_beyond_window_scores_zero_version",
            ScorerParams(version_lag_window=2),
            RequestInfo(),
            [_ep("a", policy_version=1, in_flight=0), _ep("b", policy_version=11, in_flight=3)],
            "b",
        ),
        (
            "long_queue_loses_to_idle_peer",
            p,
            RequestInfo(),
            [_ep("a", waiting=9, in_flight=8), _ep("b", waiting=0, in_flight=8)],
            "b",
        ),
        (
            "full_prefix_hit_beats_slightly_busier",
            ScorerParams(w_affinity=0.0),
            RequestInfo(),
            [_ep("a", in_flight=3, prefix_match=0.0), _ep("b", in_flight=4, prefix_match=1.0)],
            "b",
        ),
        (
            "out_of_range_signals_are_clamped",
            p,
            RequestInfo(),
            [_ep("a", kv_usage=1.7, prefix_match=-0.5), _ep("b", kv_usage=-0.2, prefix_match=0.1)],
            "b",
        ),
    ]
    # Group stickiness: with equal signals the group's home wins; it is the
    # endpoint the bounded-load ring gives the key (computed, then checked to
    # be the pick), and overloading that endpoint must move the pick.
    names = [f"vllm-{i}" for i in range(8)]
    key = "grpo-step12-group7"
    home = names[home_endpoint(key, names, [0] * 8, p.load_factor, p.virtual_nodes)]
    even = [_ep(n, in_flight=2, policy_version=5) for n in names]
    cases.append(("group_sticks_to_ring_home", p, RequestInfo(key), even, home))
    over = [_ep(n, in_flight=12 if n == home else 2, policy_version=5) for n in names]
    spill_to = names[
        home_endpoint(key, names, [e.in_flight for e in over], p.load_factor, p.virtual_nodes)
    ]
    assert spill_to != home
    cases.append(("group_spills_when_home_over_bound", p, RequestInfo(key), over, spill_to))
    # ... and its cache does not pull it back: the home holds the whole prompt, the spill target nothing
    cached = [_ep(n, in_flight=12 if n == home else 2, policy_version=5, prefix_match=1.0 if n == home else 0.0)
              for n in names]
    cases.append(("prefix_does_not_pull_past_the_bound", p, RequestInfo(key), cached, spill_to))
    # below the bound a fully cached endpoint wins over an idle one (no key: prefix against load)
    cases.append(("prefix_pulls_below_the_bound", p, RequestInfo(),
                  [_ep("a", in_flight=2, prefix_match=1.0), _ep("b", in_flight=0)], "a"))
    return cases


def _random_cases(n: int, seed: int) -> list[tuple[str, ScorerParams, RequestInfo, list[EndpointSignals]]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        params = ScorerParams(
            w_load=rng.choice([0.0, 0.5, 1.0, 2.0]),
            w_queue=rng.choice([0.0, 1.0, 2.0]),
            w_kv=rng.choice([0.0, 1.0, 2.5]),
            w_prefix=rng.choice([0.0, 3.0]),
            w_version=rng.choice([0.0, 2.0]),
            w_affinity=rng.choice([0.0, 4.0, 6.0]),
            load_factor=rng.choice([1.0, 1.1, 1.25, 2.0]),
            version_lag_window=rng.randint(1, 5),
            virtual_nodes=rng.choice([1, 4, 16]),
        )
        count = rng.choice([1, 2, 3, 8, 16, 64])
        eps = [
            _ep(
                f"ep-{j:02d}",
                in_flight=rng.randint(0, 30),
                waiting=rng.choice([0, 0, rng.randint(0, 12)]),
                kv_usage=round(rng.random(), 4),
                prefix_match=round(rng.choice([0.0, rng.random(), 1.0]), 4),
                policy_version=rng.randint(7, 10),
                updating=rng.random() < 0.1,
            )
            for j in range(count)
        ]
        req = RequestInfo(rng.choice([None, f"session-{rng.randint(0, 10**6)}"]))
        out.append((f"random_{k:02d}", params, req, eps))
    return out


def _case_json(name, params, req, eps) -> dict:
    res = score(eps, req, params, with_components=True)
    return {
        "name": name,
        "params": params.to_plugin_parameters(),
        "request": {"affinityKey": req.affinity_key},
        "endpoints": [endpoint_to_json(e) for e in eps],
        "expected": {
            "components": {c: res.components[c] for c in COMPONENTS},
            "totals": res.totals,
            "normalized": res.normalized,
            "home": None if res.home is None else eps[res.home].name,
            "pick": None if res.pick is None else eps[res.pick].name,
        },
    }


# (cached, total, prompt tokens, block tokens): llm-d's approximate producer (total counts the
# partial last block), its precise one (complete blocks only), an unknown prompt length, a prompt
# shorter than a block, a producer capped below the prompt, and a report past the total.
PREFIX_INPUTS = [(3, 4, 100, 32), (3, 3, 100, 32), (2, 4, 0, 32), (0, 1, 20, 32), (0, 0, 0, 64),
                 (5, 5, 1000, 64), (4, 4, 128, 32), (7, 4, 128, 32), (1, 3, 96, 32)]


def build() -> dict:
    """The whole vectors document; raises if a hand case's intent is not met."""
    cases = []
    for name, params, req, eps, want in _hand_cases():
        c = _case_json(name, params, req, eps)
        if c["expected"]["pick"] != want:
            raise AssertionError(f"{name}: formula picks {c['expected']['pick']}, intended {want}")
        c["intendedPick"] = want
        cases.append(c)
    cases += [_case_json(*c) for c in _random_cases(24, seed=20260717)]
    hashes = [{"input": s, "hash64": str(hash64(s))} for s in ("", "a", "vllm-0#0", "grpo-step12-group7", "ünï")]
    return {
        "about": "moerl-rl-scorer parity vectors; regenerate with `python -m router_ext.vectors`",
        "hashes": hashes,
        "prefixMatches": [{"cachedBlocks": c, "totalBlocks": t, "promptTokens": n, "blockTokens": b,
                           "prefixMatch": prefix_match(c, t, n, b)} for c, t, n, b in PREFIX_INPUTS],
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    """Write (default) or ``--check`` the vectors file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=VECTORS_PATH)
    ap.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = ap.parse_args(argv)
    text = json.dumps(build(), indent=1, ensure_ascii=False) + "\n"
    if args.check:
        if args.out.read_text() != text:
            print(f"{args.out} is stale: run python -m router_ext.vectors")
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
