"""Prefill/decode disaggregation scheduled by llm-d's own profiles, with moerl's scorer and replay intact.

The KV pool of `test_kv_pool.py` (a real ``mooncake_master``; A a prefill replica, which answers once
its KV is pooled, B a decode replica, C without pool: the reference) behind the real picker
(`moerl-epp`, llm-d-router v0.10.0) on the config ``moerl router-config --prefill-endpoints``
writes: endpoints with ``llm-d.ai/role`` labels, llm-d's ``disagg-profile-handler`` with a
``decode`` and a ``prefill`` profile (each role's filter, then ``moerl-paused-filter`` and
``moerl-rl-scorer``) and its ``prefix-based-pd-decider`` at one replica block (32) of uncached
tokens. Checked:

* `moerl rl`'s path (`rollouts.generate_group` under `rl_loop.llmd.LlmdRouter`): the picker sends
  the group to B and names A in ``x-prefiller-host-port``; A prefills, B loads every complete
  block from the pool, and the tokens and routing record equal C's, row for row;
* a three-turn conversation: each turn leaves more than a block uncached on B (the picker's
  prefix index holds what it sent there), so each is prefilled on A; the stitched record is C's;
* a prompt B already holds: the decider names no prefill replica, B serves it from its own cache;
* llm-d's ``pd-sidecar --kv-connector shared-storage`` in front of B (the path of gateway traffic):
  with the prefill header it makes the two hops itself and B's record, from the pool, is C's;
  without it the request goes straight to B.

Where github.com/llm-d/llm-d-router cannot be resolved (no Go module proxy serving it and no
LLMD_ROUTER_SRC), the module is reported "not run" with the reason and starts nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request

import aiohttp
import pytest

from router_ext.config import Disagg, EppPorts, epp_command, parse_endpoints, write
from router_ext.epp_build import Unresolvable, build
from rl_loop.llmd import PREFILL_HEADER, LlmdRouter
from rl_loop.replicas import Replica
from tests.integration.test_kv_pool import BLOCK, BLOCKS, PROMPT_LEN, Pool, hits, metric, play
from tests.integration.test_llmd_epp import _stop
from tests.ports import free_port
from vllm_ext.routing.record import decode_record_b64

pytestmark = pytest.mark.slow
# llm-d v0.10's approximate prefix index, which the prefill decider reads, counts whole blocks of at
# least 64 tokens (it raises a smaller configured size to 64)
LLMD_BLOCK = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("llmd_pd")
    try:
        binaries = build(tmp / "bin")
    except Unresolvable as e:
        pytest.skip(f"not run: {e}")
    pool = Pool(make_tiny_checkpoint("qwen3_moe", tmp / "ckpt", dtype="float32", init_scale=0.2), tmp)
    procs: list[subprocess.Popen] = []
    try:
        a, b = (pool.base[n].rpartition(":")[2] for n in "AB")
        endpoints = parse_endpoints([f"d0=127.0.0.1:{b}"], "decode") + parse_endpoints([f"p0=127.0.0.1:{a}"], "prefill")
        cfg, _ = write(endpoints, tmp / "epp", block_size_tokens=BLOCK, disagg=Disagg(non_cached_tokens=BLOCK))
        ports = EppPorts(free_port(), free_port(), free_port())
        procs.append(subprocess.Popen(epp_command(cfg, binary=str(binaries.epp), ports=ports),
                                      stdout=open(tmp / "epp.log", "w"), stderr=subprocess.STDOUT))
        sidecar_port = free_port()
        procs.append(subprocess.Popen([str(binaries.sidecar), "--port", str(sidecar_port), "--model-server-port", b,
                                       "--kv-connector", "shared-storage", "--secure-proxy=false"],
                                      stdout=open(tmp / "sidecar.log", "w"), stderr=subprocess.STDOUT))
        replicas = [Replica(name="p0", base_url=pool.base["A"], role="prefill"),
                    Replica(name="d0", base_url=pool.base["B"], role="decode")]
        router = LlmdRouter(f"127.0.0.1:{ports.grpc}", retry_for_s=5)
        deadline = time.time() + 90
        while True:  # the picker up, and both replicas scraped (a short prompt: nothing to prefill)
            try:
                play(pool, replicas, [1, 2, 3], pick=router, key="warm-up")
                urllib.request.urlopen(f"http://127.0.0.1:{sidecar_port}/health", timeout=5).read()
                break
            except Exception as e:  # noqa: BLE001 - not up yet; said if it never is
                assert all(p.poll() is None for p in procs), (tmp / "epp.log").read_text()[-3000:]
                assert time.time() < deadline, f"{e!r}\n" + (tmp / "epp.log").read_text()[-3000:]
                time.sleep(0.5)
        yield {"pool": pool, "replicas": replicas, "router": router, "sidecar": f"http://127.0.0.1:{sidecar_port}"}
    finally:
        for p in procs:
            _stop(p)
        pool.close()


def _reference(pool, prompt, turns=1):
    return play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt, turns=turns)[0]


def test_llmd_names_the_prefill_replica_and_the_record_is_one_replicas(stack):
    pool = stack["pool"]
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    conv, counters = play(pool, stack["replicas"], prompt, pick=stack["router"], key="single")
    assert counters["prefills"] == 1 and not counters.get("prefill_skipped") and not counters.get("flush_timeouts")
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK  # every complete block from A, through the pool
    ref = _reference(pool, prompt)
    assert conv.completion_ids == ref.completion_ids
    assert (conv.routing() == ref.routing()).all() and conv.routing().shape[0] == PROMPT_LEN + 4 - 1


def test_a_conversation_through_llmds_profiles_stitches_one_replicas_record(stack):
    pool = stack["pool"]
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    conv, counters = play(pool, stack["replicas"], prompt, turns=3, pick=stack["router"], key="conversation")
    # turns 2 and 3 (134 and 168 tokens) leave 70 and 40 tokens past the whole 64-token blocks the picker
    # sent B before: each more than a block of uncached tokens, so each is prefilled on A
    assert counters["prefills"] == 3 and not counters.get("prefill_skipped")
    assert hits(pool.base["B"]) - before == (BLOCKS + 2) * BLOCK
    ref = _reference(pool, prompt, turns=3)
    assert conv.ids == ref.ids and conv.rows_per_turn == ref.rows_per_turn
    assert (conv.routing() == ref.routing()).all()


def test_a_prompt_the_decode_replica_holds_is_not_prefilled(stack):
    pool = stack["pool"]
    prompt = pool.prompt() + list(range(3, 3 + 2 * LLMD_BLOCK - PROMPT_LEN))  # two whole blocks of the index
    play(pool, stack["replicas"], prompt, pick=stack["router"], key="again")
    prefilled = metric(pool.base["A"], "vllm:prompt_tokens_total")
    conv, counters = play(pool, stack["replicas"], prompt, pick=stack["router"], key="again")
    assert not counters.get("prefills") and not counters.get("prefill_skipped")  # nothing uncached: B alone
    assert metric(pool.base["A"], "vllm:prompt_tokens_total") == prefilled
    assert (conv.routing() == _reference(pool, prompt).routing()).all()


def _through_sidecar(stack, prompt: list[int], headers: dict[str, str]):
    pool = stack["pool"]

    async def post():
        async with aiohttp.ClientSession() as session:
            async with session.post(stack["sidecar"] + "/v1/completions", headers=headers, json={
                    "model": pool.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                    "ignore_eos": True}) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]

    choice = asyncio.run(post())
    assert choice.get("routed_experts") is not None, choice.get("routed_experts_error")
    return choice["text"], decode_record_b64(choice["routed_experts"])


def test_llmds_pd_sidecar_makes_the_two_hops_through_the_pool(stack):
    pool = stack["pool"]
    a_port = pool.base["A"].rpartition(":")[2]
    prompt = pool.prompt()
    before, prefilled = hits(pool.base["B"]), metric(pool.base["A"], "vllm:prompt_tokens_total")
    text, rec = _through_sidecar(stack, prompt, {PREFILL_HEADER: f"127.0.0.1:{a_port}"})
    assert metric(pool.base["A"], "vllm:prompt_tokens_total") - prefilled == PROMPT_LEN
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK
    assert (text, rec) == pool.generate("C", prompt)

    prompt = pool.prompt()
    before, prefilled = hits(pool.base["B"]), metric(pool.base["A"], "vllm:prompt_tokens_total")
    assert _through_sidecar(stack, prompt, {}) == pool.generate("C", prompt)
    assert metric(pool.base["A"], "vllm:prompt_tokens_total") == prefilled and hits(pool.base["B"]) == before
