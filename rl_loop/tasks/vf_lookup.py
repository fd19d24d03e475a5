"""The built-in agentic task: a `verifiers` ToolEnv whose answer is only known to its tool.

`rollout.task = "verifiers:rl_loop.tasks.vf_lookup"` (configs/tiny_kimi_k2_tools.toml).
Each prompt asks for the code stored under a key ("code of k7?"); the one tool,
`lookup(key)`, returns it (a 3-digit code derived from the key, unguessable without
the tool). The reward is 1 when the final reply contains the code, else the fraction
of its digits the reply gets in place, plus `tool_bonus` (0.5) for a well-formed
`lookup` call followed by a reply: a tiny model copies a code only after much
training, and the bonus gives it a gradient towards the tool before it can (the
shaping agentic curricula use). A bonus for the call alone is a trap: a policy that
calls on every turn until `max_turns` keeps the bonus and never replies (measured:
tool use 0.51 -> 0.97 and reward 0.28 -> 0.49 over 30 steps, nearly all of it bonus).
The `ToolEnv`'s own metrics count the calls. So a policy learns to call the tool, with
well-formed arguments, and to copy its answer: the smallest agentic loop, small
enough for the tiny CPU models.

The tool is a module-level function, so the sandbox ships it by reference and the
sandboxed process imports only this module's light top (`code_of` needs nothing).
"""

from __future__ import annotations

import hashlib
import random


def code_of(key: str) -> str:
    """The code stored under `key`: three digits from a hash of it."""
    return f"{int(hashlib.sha256(key.encode()).hexdigest(), 16) % 1000:03d}"


def lookup(key: str) -> str:
    """The code stored under a key.

    Args:
        key: the key, e.g. k7
    """
    return code_of(key.strip())


# `lookup` as the environment declares it (verifiers' convert_func_to_tool_def, in OpenAI form): the text the
# tiny tokenizer is trained on (chat_templates.sample_conversations); a test checks the two agree.
TOOL_SPEC = {"type": "function", "function": {
    "name": "lookup", "description": "The code stored under a key.",
    "parameters": {"properties": {"key": {"description": "the key, e.g. k7", "title": "Key", "type": "string"}},
                   "required": ["key"], "title": "lookup_args", "type": "object", "additionalProperties": False}}}


def _field(message, name: str):
    """A message's field: verifiers hands the rubric dicts or message objects."""
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def _replies(completion) -> list:
    return [m for m in completion or [] if _field(m, "role") == "assistant"]


def _final_reply(completion) -> str:
    replies = _replies(completion)
    content = _field(replies[-1], "content") if replies else None
    return content if isinstance(content, str) else ""


def copied_code(completion, info, **kwargs) -> float:
    """1 if the final reply contains the key's code, else the fraction of the code's digits in place."""
    code, reply = code_of(info["key"]), _final_reply(completion)
    if code in reply:
        return 1.0
    return sum(a == b for a, b in zip(code, reply.strip())) / len(code)


def replied_after_lookup(completion, **kwargs) -> float:
    """1 if the policy made a well-formed `lookup` call (the parser read it and the environment ran it) and then
    replied without another call."""
    replies = _replies(completion)
    if not replies or _field(replies[-1], "tool_calls"):
        return 0.0
    for m in replies:
        for c in _field(m, "tool_calls") or []:
            name = c["function"]["name"] if isinstance(c, dict) else c.name
            if name == "lookup":
                return 1.0
    return 0.0


def load_environment(size: int = 100, seed: int = 0, max_turns: int = 3, tool_bonus: float = 0.5):
    import verifiers as vf
    from datasets import Dataset

    rng = random.Random(seed)
    keys = [f"k{rng.randrange(100)}" for _ in range(size)]
    rows = [{"question": f"code of {k}?", "answer": code_of(k), "info": {"key": k}} for k in keys]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[lookup], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[copied_code, replied_after_lookup], weights=[1.0, tool_bonus]))
