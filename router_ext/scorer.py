"""The moerl RL-aware endpoint scoring formula, host independent.

This module is the single source of truth for how moerl ranks inference
endpoints for an RL rollout request. The same formula runs in two places:

* here, in Python, inside the embedded single-machine router of ``moerl rl``;
* in Go, as the llm-d endpoint-picker scorer plugin ``moerl-rl-scorer``
  (``router_ext/epp``).

Both are checked against ``router_ext/testdata/vectors.json``, so any change to
the formula must change both implementations and regenerate the vectors
(``python -m router_ext.vectors``).

The formula
-----------
For a request and a list of endpoints, let *A* be the endpoints that are not
paused for a weight update. Paused endpoints get every component and the total
equal to 0 and are never picked (a paused vLLM replica would hold the request
until the swap ends, and may finish it on the new weights). Over *A*:

============ =====================================================================
component    score in [0, 1]
============ =====================================================================
load         ``1 - in_flight / max(in_flight over A)`` (1 when that max is 0)
queue        ``1 - waiting / max(waiting over A)`` (1 when that max is 0)
kv           ``1 - kv_usage`` (clamped to [0, 1])
prefix       ``prefix_match``: fraction of the prompt's complete blocks cached
             (clamped; ``prefix_match()`` below); 0 at an endpoint whose load is
             at or past the load bound (below)
version      ``1 - min(lag, version_lag_window) / version_lag_window`` where
             ``lag = current - policy_version`` and ``current`` is the highest
             policy version over all endpoints: a replica still on old weights
             produces more off-policy rollouts, so it is preferred less.
affinity     1 for the request's *home* endpoint, 0 elsewhere (0 everywhere when
             the request has no affinity key).
============ =====================================================================

The home endpoint comes from consistent hashing with bounded loads (Mirrokni,
Thorup, Zadimoghaddam 2018): every active endpoint owns ``virtual_nodes``
points on a 64-bit ring; the key's point is found and the ring is walked
clockwise to the first endpoint whose load (``in_flight + waiting``) is below
``ceil(load_factor * (total_load + 1) / len(A))``. So all samples of one GRPO
group (or all turns of one session) land on one endpoint, reusing its prefix
cache, as long as that endpoint is not more than ``load_factor`` times the
average; beyond that the key spills to the next endpoint on the ring, which is
again the same for every request of the key. Hashes are the first 8 bytes
(big endian) of SHA-256, available bit-identically in Go and Python. The same
bound holds the prefix term: past it, an endpoint's cached blocks no longer
pull requests (with affinity alone a conversation spilled off its home came
back to it for its cache, so the bound held only the affinity term).

``total = w_load*load + w_queue*queue + w_kv*kv + w_prefix*prefix
+ w_version*version + w_affinity*affinity`` (summed in that order so Go and
Python round identically); ``normalized = total / sum(weights)`` is the [0, 1]
value the Go plugin hands to llm-d. The pick is the active endpoint with the
highest total; ties go to the smallest endpoint name, so the choice is
deterministic and reproducible across languages.

Everything here is plain Python (no numpy): for 64 endpoints one call costs a
few tens of microseconds, well below the 100 us p99 budget, and importing it is
free for the embedded router.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = [
    "COMPONENTS",
    "EndpointSignals",
    "RequestInfo",
    "ScoreResult",
    "ScorerParams",
    "hash64",
    "home_endpoint",
    "load_capacity",
    "prefix_match",
    "score",
]

#: Component names, in the order they are summed.
COMPONENTS: tuple[str, ...] = ("load", "queue", "kv", "prefix", "version", "affinity")


@dataclass(frozen=True, slots=True)
class EndpointSignals:
    """What the router knows about one endpoint when a request arrives.

    ``in_flight`` is the requests the router sent there and has not seen
    answered, counted by the router itself (the embedded router's
    ``Replica.in_flight``, the llm-d plugin's request hooks): vLLM's
    ``vllm:num_requests_running``, scraped, lags and still counts a batch that
    has just finished. ``waiting`` mirrors ``vllm:num_requests_waiting`` and
    ``kv_usage`` ``vllm:kv_cache_usage_perc`` (a fraction);
    ``prefix_match`` is the fraction of this request's complete prompt blocks
    the endpoint is believed to hold (``prefix_match()`` of llm-d's prefix
    match info);
    ``policy_version`` and ``updating`` come from vllm_ext's RL metrics.
    """

    name: str
    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_match: float = 0.0
    policy_version: int = 0
    updating: bool = False


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """The request-side input: only the affinity key matters to the formula.

    ``affinity_key`` is the GRPO group id or multi-turn session id; ``None``
    means the request may go anywhere (no affinity term).
    """

    affinity_key: str | None = None


@dataclass(frozen=True, slots=True)
class ScorerParams:
    """Weights and bounds; the Go plugin takes the same names in camelCase.

    Defaults come from ``benchmarks/router.py`` (GRPO groups of 16, 8..64
    endpoints): affinity (2) weighs less than a full prefix hit (3), so below
    the load bound a replica already holding a group's prompt wins over the
    group's cold ring home; ``load_factor`` 1.5 lets a 16-request burst land
    on one replica. That kept the hit rate >= 0.96 of the oracle with
    max/mean requests served <= 1.2; 1.25 split groups and lost about 10% of
    the oracle's hits. ``virtual_nodes`` 128: few replicas need many points
    each for even arcs (two share the ring within 1% of half; with 16 points
    each, most of the 16 groups of ``benchmarks.llmd_e2e`` had the same home).
    """

    w_load: float = 1.0
    w_queue: float = 2.0
    w_kv: float = 1.0
    w_prefix: float = 3.0
    w_version: float = 2.0
    w_affinity: float = 2.0
    load_factor: float = 1.5
    version_lag_window: int = 4
    virtual_nodes: int = 128

    def __post_init__(self) -> None:
        for name in ("w_load", "w_queue", "w_kv", "w_prefix", "w_version", "w_affinity"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (bounded loads need c >= 1)")
        if self.version_lag_window < 1:
            raise ValueError("version_lag_window must be >= 1")
        if self.virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")

    def to_plugin_parameters(self) -> dict:
        """The ``parameters:`` block of ``moerl-rl-scorer`` in an EndpointPickerConfig.

        Same shape the Go plugin decodes (strictly: unknown keys are errors),
        and the shape the shared test vectors use.
        """
        return {
            "weights": {c: getattr(self, f"w_{c}") for c in COMPONENTS},
            "loadFactor": self.load_factor,
            "versionLagWindow": self.version_lag_window,
            "virtualNodes": self.virtual_nodes,
        }

    @classmethod
    def from_plugin_parameters(cls, params: dict) -> "ScorerParams":
        """Inverse of :meth:`to_plugin_parameters`; missing keys keep defaults."""
        unknown = set(params) - {"weights", "loadFactor", "versionLagWindow", "virtualNodes"}
        weights = params.get("weights", {})
        unknown |= {f"weights.{k}" for k in set(weights) - set(COMPONENTS)}
        if unknown:
            raise ValueError(f"unknown moerl-rl-scorer parameters: {sorted(unknown)}")
        kw: dict = {f"w_{c}": float(v) for c, v in weights.items()}
        if "loadFactor" in params:
            kw["load_factor"] = float(params["loadFactor"])
        if "versionLagWindow" in params:
            kw["version_lag_window"] = int(params["versionLagWindow"])
        if "virtualNodes" in params:
            kw["virtual_nodes"] = int(params["virtualNodes"])
        return cls(**kw)

    @property
    def weight_sum(self) -> float:
        """Sum of weights, in component order (the normalisation constant)."""
        return (
            self.w_load + self.w_queue + self.w_kv + self.w_prefix + self.w_version + self.w_affinity
        )


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Per-endpoint totals (same order as the input) and the pick.

    ``components[c][i]`` is component ``c`` of endpoint ``i`` (only filled when
    asked for, since building it costs time on the routing hot path);
    ``pick`` is an index into the input, or ``None`` when every endpoint is
    paused; ``home`` is the bounded-load home index (``None`` without a key).
    """

    totals: list[float]
    normalized: list[float]
    pick: int | None
    home: int | None
    components: dict[str, list[float]] = field(default_factory=dict)


def hash64(data: str) -> int:
    """First 8 bytes of SHA-256 as a big-endian unsigned int (same in Go)."""
    return int.from_bytes(hashlib.sha256(data.encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=64)
def _ring(names: tuple[str, ...], virtual_nodes: int) -> tuple[list[int], list[int]]:
    """Sorted ring points and, for each, the index into ``names`` owning it.

    Cached per endpoint set: the set changes only when a replica pauses,
    resumes, joins or leaves, while requests arrive thousands of times a
    second. Ties between equal hashes (never seen with SHA-256) break by name.
    """
    points = sorted(
        (hash64(f"{name}#{v}"), name, i) for i, name in enumerate(names) for v in range(virtual_nodes)
    )
    return [p[0] for p in points], [p[2] for p in points]


def prefix_match(cached_blocks: int, total_blocks: int, prompt_tokens: int, block_tokens: int) -> float:
    """The prefix component's input: the fraction of the prompt's *complete* blocks an endpoint holds.

    A prefix producer reports `cached_blocks` of its `total_blocks` for the prompt. llm-d's
    approximate producer counts the partial last block in `total_blocks`, which no replica can
    have cached (vLLM caches full blocks only), so a conversation held entirely by one replica
    scored below 1 there and lost to load. Over the prompt's complete blocks (`prompt_tokens //
    block_tokens`, when the prompt length is known: `prompt_tokens` > 0) it scores 1. 0 when the
    prompt has no complete block.
    """
    full = total_blocks
    if prompt_tokens > 0 and block_tokens > 0:
        full = min(full, prompt_tokens // block_tokens)
    if full <= 0:
        return 0.0
    return min(max(cached_blocks, 0), full) / full


def load_capacity(loads: Sequence[int], load_factor: float) -> int:
    """The bound on one endpoint's load: ``ceil(load_factor * (sum(loads) + 1) / n)``."""
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


def home_endpoint(
    key: str, names: Sequence[str], loads: Sequence[int], load_factor: float, virtual_nodes: int,
    active: Sequence[int] | None = None,
) -> int:
    """Index of ``key``'s home among ``names`` (consistent hashing, bounded loads).

    ``loads[i]`` is endpoint i's current load; ``active`` the indices that may
    take the key (default: all). The capacity is
    ``ceil(load_factor * (sum of the active loads + 1) / len(active))``: the
    ``+ 1`` counts the request being placed, as in the paper, which guarantees
    that some endpoint is below capacity whenever ``load_factor >= 1``. The
    ring holds every name and the walk passes the inactive ones, which gives
    each key the home a ring of the active names alone would, while a pause
    or a resume leaves the cached ring as it is.
    """
    if not names:
        raise ValueError("no endpoints")
    allowed = range(len(names)) if active is None else active
    if not allowed:
        raise ValueError("no active endpoints")
    cap = load_capacity([loads[i] for i in allowed], load_factor)
    allowed = set(allowed)
    hashes, owners = _ring(tuple(names), virtual_nodes)
    m = len(hashes)
    start = bisect.bisect_left(hashes, hash64(key))
    for step in range(m):
        i = owners[(start + step) % m]
        if i in allowed and loads[i] < cap:
            return i
    raise AssertionError("unreachable: some endpoint is always below capacity")  # pragma: no cover


def score(
    endpoints: Sequence[EndpointSignals],
    request: RequestInfo,
    params: ScorerParams = ScorerParams(),
    *,
    with_components: bool = False,
) -> ScoreResult:
    """Score every endpoint for ``request`` and pick one (see module docstring)."""
    n = len(endpoints)
    active = [i for i in range(n) if not endpoints[i].updating]
    zeros = [0.0] * n
    totals = zeros[:]
    comps: dict[str, list[float]] = {c: zeros[:] for c in COMPONENTS} if with_components else {}
    if not active:
        return ScoreResult(totals, zeros[:], None, None, comps)

    current = max(e.policy_version for e in endpoints)
    max_if = max(endpoints[i].in_flight for i in active)
    max_wait = max(endpoints[i].waiting for i in active)
    window = params.version_lag_window

    loads = [e.in_flight + e.waiting for e in endpoints]
    cap = load_capacity([loads[i] for i in active], params.load_factor)
    home = None
    if request.affinity_key is not None:
        names = [e.name for e in endpoints]
        home = home_endpoint(
            request.affinity_key, names, loads, params.load_factor, params.virtual_nodes, active
        )

    wl, wq, wk, wp, wv, wa = (
        params.w_load,
        params.w_queue,
        params.w_kv,
        params.w_prefix,
        params.w_version,
        params.w_affinity,
    )
    best = -1
    best_total = -1.0
    for i in active:
        e = endpoints[i]
        s_load = 1.0 - e.in_flight / max_if if max_if > 0 else 1.0
        s_queue = 1.0 - e.waiting / max_wait if max_wait > 0 else 1.0
        kv = e.kv_usage
        s_kv = 1.0 - (0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv)
        pm = e.prefix_match
        s_prefix = 0.0 if pm < 0.0 or loads[i] >= cap else 1.0 if pm > 1.0 else pm
        lag = current - e.policy_version
        s_version = 1.0 - (lag if lag < window else window) / window
        s_aff = 1.0 if i == home else 0.0
        t = wl * s_load + wq * s_queue + wk * s_kv + wp * s_prefix + wv * s_version + wa * s_aff
        totals[i] = t
        if t > best_total or (t == best_total and e.name < endpoints[best].name):
            best, best_total = i, t
        if with_components:
            comps["load"][i] = s_load
            comps["queue"][i] = s_queue
            comps["kv"][i] = s_kv
            comps["prefix"][i] = s_prefix
            comps["version"][i] = s_version
            comps["affinity"][i] = s_aff
    ws = params.weight_sum
    normalized = [t / ws for t in totals] if ws > 0 else zeros[:]
    return ScoreResult(totals, normalized, best, home, comps)
