"""Replay router_ext/testdata/vectors.json through the Python scorer.

The Go plugin replays the same file in ``go test ./...`` (router_ext/epp), so
both implementations agree on every case.
"""

from __future__ import annotations

import json
import math

import pytest

from router_ext import vectors
from router_ext.scorer import COMPONENTS, RequestInfo, ScorerParams, hash64, score

DOC = json.loads(vectors.VECTORS_PATH.read_text())


def test_vectors_file_is_up_to_date():
    assert vectors.main(["--check"]) == 0


def test_hash_vectors():
    for h in DOC["hashes"]:
        assert hash64(h["input"]) == int(h["hash64"])


def _assert_close_lists(got, want, endpoints: int):
    """One value per endpoint of the case, each within the 1e-12 the Go port is held to."""
    assert len(got) == len(want) == endpoints > 0, (got, want)
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("case", DOC["cases"], ids=lambda c: c["name"])
def test_case(case):
    params = ScorerParams.from_plugin_parameters(case["params"])
    eps = [vectors.endpoint_from_json(e) for e in case["endpoints"]]
    res = score(eps, RequestInfo(case["request"]["affinityKey"]), params, with_components=True)
    exp = case["expected"]
    for c in COMPONENTS:
        _assert_close_lists(res.components[c], exp["components"][c], len(eps))
    _assert_close_lists(res.totals, exp["totals"], len(eps))
    _assert_close_lists(res.normalized, exp["normalized"], len(eps))
    assert (None if res.pick is None else eps[res.pick].name) == exp["pick"]
    assert (None if res.home is None else eps[res.home].name) == exp["home"]
    if "intendedPick" in case:
        assert exp["pick"] == case["intendedPick"]


def test_vectors_cover_the_rules():
    names = {c["name"] for c in DOC["cases"]}
    for needed in ("paused_endpoint_never_picked_even_if_best", "all_paused_picks_nothing",
                   "stale_policy_version_loses", "group_sticks_to_ring_home",
                   "group_spills_when_home_over_bound"):
        assert needed in names
    assert sum(1 for c in DOC["cases"] if len(c["endpoints"]) == 64) >= 1
