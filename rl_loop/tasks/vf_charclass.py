"""The multi-turn charclass game as a `verifiers` environment (an example, and the e2e test of the adapter).

`moerl rl` loads it with `rollout.task = "verifiers:rl_loop.tasks.vf_charclass"`
(`verifiers.load_environment` imports the module and calls `load_environment`),
exactly as it loads an environment package from PyPI or the Environments Hub. The
dataset is built in code (no download); `env_response` judges the model's last
reply and names the next class; the rubric's reward is the mean per-turn fraction
of characters in the asked class, the same score as the built-in
`charclass_turns`.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

from .charclass import CLASSES, class_fraction


def _replies(completion) -> list[str]:
    texts = []
    for m in completion or []:
        role = m["role"] if isinstance(m, dict) else m.role
        if role == "assistant":
            content = m["content"] if isinstance(m, dict) else m.content
            texts.append(content or "")
    return texts


def charclass_reward(completion, info, **kwargs) -> float:
    """Mean over turns of the fraction of the reply's non-space characters in the turn's class."""
    classes = info["classes"]
    replies = _replies(completion)
    return sum(class_fraction(c, r) for c, r in zip(classes, replies)) / len(classes)


class CharClassTurnsEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        classes = state["info"]["classes"]
        replies = _replies(messages)
        verdict = "ok" if class_fraction(classes[len(replies) - 1], replies[-1]) >= 0.5 else "no"
        return [vf.UserMessage(content=f"{verdict}. write {classes[len(replies)]}:")]


def load_environment(turns: int = 2, size: int = 64, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        classes = [rng.choice(sorted(CLASSES)) for _ in range(turns)]
        rows.append({"question": f"write {classes[0]}:", "answer": "", "info": {"classes": classes}})
    return CharClassTurnsEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[charclass_reward]),
                             max_turns=turns)
