"""The embedded router: router_ext's scorer in front of the managed replicas.

On one machine there is no llm-d; the orchestrator asks this function where each
group goes, using the same formula (router_ext.scorer) the llm-d plugin runs, fed
with what the orchestrator knows first-hand: requests in flight per replica, its
policy version and whether it is updating. Groups stick to a replica (bounded
consistent hashing on the group key) while load allows.
"""

from __future__ import annotations

from router_ext.scorer import EndpointSignals, RequestInfo, ScorerParams, score

from .replicas import Replica


def embedded_pick(replicas: list[Replica], key: str, params: ScorerParams = ScorerParams()) -> Replica:
    signals = [
        EndpointSignals(name=r.name, in_flight=r.in_flight, policy_version=r.policy_version, updating=r.updating)
        for r in replicas
    ]
    result = score(signals, RequestInfo(affinity_key=key), params)
    if result.pick is None:
        raise RuntimeError("no replica can take the request (all paused or down)")
    return replicas[result.pick]
