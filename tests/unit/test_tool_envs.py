"""Tool-calling rollouts without a server: vLLM's kimi_k2 parser on the sampled text, the chat template's
rendering of tool turns appended to one token sequence, malformed calls as scored outcomes, sandboxed tools.

`ToolReplicas` stands in for the vLLM replicas: each turn it "samples" a scripted reply (tokenized),
with the routing rows of `fake_routing`, so the stitched sequence and record can be checked exactly.
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from rl_loop.chat_templates import KIMI_K2, sample_conversations
from rl_loop.config import RLConfig
from rl_loop.replicas import Replica
from rl_loop.rollouts import Completion, RolloutContext
from rl_loop.tasks import get_task
from rl_loop.tasks.verifiers_env import VerifiersTask, _native_tool
from rl_loop.tasks.vf_lookup import TOOL_SPEC, code_of, load_environment
from rl_loop.tools.parsing import ToolCallParser, tool_metrics
from rl_loop.tools.sandbox import SandboxLimits
from titan_ext.tiny_assets import train_tokenizer

L, K, E = 2, 2, 16


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tok")
    train_tokenizer(d, special_tokens=KIMI_K2.special_tokens, extra_corpus=tuple(sample_conversations(KIMI_K2, 50)),
                    chat_template=KIMI_K2.template)
    return AutoTokenizer.from_pretrained(d)


def fake_routing(ids: list[int]) -> np.ndarray:
    return np.array([[[(ids[t] * 31 + t * 7 + layer * 13 + j) % E for j in range(K)] for layer in range(L)]
                     for t in range(len(ids))])


def call_text(key: str, name: str = "lookup") -> str:
    return (f'<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>'
            f'{{"key": "{key}"}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')


class ToolReplicas(RolloutContext):
    """Replies from `script` (one text per turn, per rollout in order of requests of that rollout)."""

    script: list[str]
    calls: list

    async def complete(self, key, prompt_ids, *, seed, n=1, routing_start=0, max_tokens=None, stop_token_ids=()):
        turn = sum(1 for k, *_ in self.calls if k == key)
        self.calls.append((key, list(prompt_ids), routing_start, tuple(stop_token_ids)))
        ids = self.tokenizer(self.script[turn], add_special_tokens=False).input_ids
        full = list(prompt_ids) + ids
        comp = Completion(ids, [-0.5] * len(ids), self.script[turn], fake_routing(full)[routing_start:len(full) - 1],
                          "stop")
        return [comp], self.replicas[0]


def scripted(tok, script):
    ctx = ToolReplicas(None, [Replica("r0", "http://scripted", policy_version=2)], None, "m", tok, 64, 1.0, 10.0)
    ctx.script, ctx.calls = script, []
    return ctx


def lookup_task(**limits):
    return VerifiersTask("lookup", environment=load_environment(size=4), chat_format="template",
                         tool_parser="kimi_k2", sandbox=SandboxLimits(**limits) if limits else None)


def test_a_three_turn_tool_conversation_is_one_sequence_as_the_template_renders_it(tok):
    task = lookup_task(wall_s=30.0)
    prompt = task.prompts(random.Random(0), 1)[0]
    key = prompt.meta["input"]["info"]["key"]
    script = [call_text("k1"), call_text(key), f"{code_of(key)}<|im_end|>"]
    ctx = scripted(tok, script)
    (ep,) = asyncio.run(task.run_group(ctx, prompt, 1, "g", 0))
    conv = ep.conversation
    assert ep.error is None and conv.turns == 3 and ep.reward == 1.0 + 0.5  # the code, and the tool bonus
    # the sequence is the template's rendering of the whole conversation, with the sampled turns as sampled
    messages = [{"role": "user", "content": f"code of {key}?"}]
    for i, k in enumerate(["k1", key]):
        call = {"id": "functions.lookup:0", "type": "function",
                "function": {"name": "lookup", "arguments": f'{{"key": "{k}"}}'}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": code_of(k)}]
    messages.append({"role": "assistant", "content": code_of(key)})
    expected = tok.apply_chat_template(messages, tools=[TOOL_SPEC], tokenize=False)
    assert tok.decode(conv.ids) == expected
    sampled = [tok(t, add_special_tokens=False).input_ids for t in script]
    masked = [i for i, m in zip(conv.completion_ids, conv.mask) if m]
    assert masked == [t for ids in sampled for t in ids]  # trained on exactly the sampled tokens
    # every turn stopped at <|im_end|>, asked only for new routing rows, and the record covers every position
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert [c[3] for c in ctx.calls] == [(im_end,)] * 3
    assert np.array_equal(conv.routing(), fake_routing(conv.ids)[: len(conv.ids) - 1])
    assert {k: ctx.counters[k] for k in ("rollouts", "tool_rollouts", "tool_calls")} == \
           {"rollouts": 1, "tool_rollouts": 1, "tool_calls": 2}
    assert tool_metrics(ctx.counters) == {"tool_use_rate": 1.0, "tool_calls": 2, "malformed_tool_calls": 0}


def test_calling_until_max_turns_earns_no_tool_bonus(tok):
    """The bonus is for a lookup followed by a reply: a policy that calls on every turn never answers."""
    task = lookup_task(wall_s=30.0)
    prompt = task.prompts(random.Random(0), 1)[0]
    key = prompt.meta["input"]["info"]["key"]
    (ep,) = asyncio.run(task.run_group(scripted(tok, [call_text(key)] * 3), prompt, 1, "g", 0))
    assert ep.error is None and ep.conversation.turns == 3 and ep.reward == 0.0


UNCLOSED_CALL = '<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{"key": "k1"}'


@pytest.mark.parametrize("reply", [
    "<|tool_calls_section_begin|>12<|im_end|>",
    # vLLM's parser reads these calls, but the template would close them with markers the model did not sample:
    # before, the next turn refused the rollout ("rewrites history"); now they are malformed turns
    UNCLOSED_CALL + "<|im_end|>",
    UNCLOSED_CALL + "<|tool_call_end|><|im_end|>",
])
def test_a_malformed_call_is_a_scored_turn_not_an_error(tok, reply):
    task = lookup_task()
    prompt = task.prompts(random.Random(1), 1)[0]
    ctx = scripted(tok, [reply, "unused"])
    (ep,) = asyncio.run(task.run_group(ctx, prompt, 1, "g", 0))
    assert ep.error is None and ep.conversation.turns == 1 and ep.reward < 1.0
    assert tok.decode(ep.conversation.completion_ids) == reply
    assert tool_metrics(ctx.counters) == {"tool_use_rate": 0.0, "tool_calls": 0, "malformed_tool_calls": 1}


def test_a_hanging_tool_ends_its_turn_with_a_message_the_policy_sees(tok):
    env = load_environment(size=4)

    def lookup(key: str) -> str:
        """Never answers."""
        time.sleep(1000)

    env.tool_map["lookup"] = lookup
    task = VerifiersTask("hang", environment=env, chat_format="template", tool_parser="kimi_k2",
                         sandbox=SandboxLimits(wall_s=1.0))
    prompt = task.prompts(random.Random(2), 1)[0]
    ctx = scripted(tok, [call_text("k3"), "no<|im_end|>"])
    t0 = time.monotonic()
    (ep,) = asyncio.run(task.run_group(ctx, prompt, 1, "g", 0))
    assert time.monotonic() - t0 < 10 and ep.error is None and ep.conversation.turns == 2
    assert "## Return of functions.lookup:0\ntool error: timed out after 1 s" in tok.decode(ep.conversation.ids)


@pytest.mark.parametrize("text, why", [
    (call_text("k1", name="erase"), "not one of the tools"),
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{"key": k1'
     '<|tool_call_end|><|tool_calls_section_end|>', "not a JSON object"),
    ("<|tool_calls_section_begin|>", "marker but no call"),
])
def test_the_parser_reports_what_is_malformed(tok, text, why):
    turn = ToolCallParser("kimi_k2", tok, [TOOL_SPEC]).parse(text)
    assert turn.malformed and why in turn.malformed and turn.tool_calls == [] and turn.content == text


def test_the_parser_is_vllms_and_plain_text_is_no_call(tok):
    parser = ToolCallParser("kimi_k2", tok, [TOOL_SPEC])
    assert type(parser._cls).__module__.startswith("vllm") or parser._cls.__module__.startswith("vllm")
    turn = parser.parse("before " + call_text("k9")[:-len("<|im_end|>")])
    assert turn.malformed is None and turn.content == "before "
    assert turn.tool_calls == [{"id": "functions.lookup:0", "type": "function",
                                "function": {"name": "lookup", "arguments": '{"key": "k9"}'}}]
    assert parser.parse("417").message() == {"role": "assistant", "content": "417"}
    with pytest.raises(ValueError, match="not a vLLM tool parser"):
        ToolCallParser("no_such_parser", tok, [TOOL_SPEC])


def test_the_builtin_environment_loads_by_id_and_declares_the_trained_tool(tmp_path):
    task = get_task("verifiers:rl_loop.tasks.vf_lookup", {"size": 8}, tool_parser="kimi_k2")
    assert task.has_tools and len(task.dataset) == 8
    assert [_native_tool(t) for t in task.env.tool_defs] == [TOOL_SPEC]
    with pytest.raises(ValueError, match="needs a tool parser"):
        get_task("verifiers:rl_loop.tasks.vf_lookup", {"size": 8})
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\ntask = "verifiers:rl_loop.tasks.vf_lookup"\n')
    cfg = RLConfig.from_toml(path, {"rollout.tool_wall_s": 2.5})
    assert (cfg.rollout.tool_parser, cfg.rollout.tool_sandbox, cfg.rollout.tool_wall_s) == ("auto", True, 2.5)
