"""A verifiable toy task a tiny random MoE learns on CPU in minutes, single- and multi-turn.

The prompt names a character class ("write digits:" / "write letters:"); the
reward is the fraction of the completion's non-space characters in that class.
A random policy already scores 0.2-0.4 (the tiny tokenizer has many digit and
letter tokens), so every group has reward variance from the first step, and the
policy must condition on the prompt to do well on both classes.

`charclass_turns` plays it over several turns in one conversation: after each
reply the environment says how it went and names the next class
(" ok. write letters:"), each turn's class drawn independently, and the reward is
the mean of the per-turn fractions. The policy must follow the latest
instruction, not the first one, and it is trained only on its own replies.
"""

from __future__ import annotations

import random

from .base import Prompt, TextTurnsTask

CLASSES = {
    "digits": str.isdigit,
    "letters": lambda c: c.isascii() and c.isalpha(),
}


def class_fraction(cls: str, text: str) -> float:
    """Fraction of the non-space characters of `text` in class `cls` (0 for an empty text)."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    test = CLASSES[cls]
    return sum(1 for c in chars if test(c)) / len(chars)


class CharClassTask:
    """`preamble`: text before every prompt, as an agent's system prompt is: prompts that span KV
    blocks, shared by every group (what prefix caching and the KV pool serve)."""

    name = "charclass"

    def __init__(self, preamble: str = ""):
        self.preamble = str(preamble)

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            cls = rng.choice(sorted(CLASSES))
            out.append(Prompt(f"{self.preamble}write {cls}:", {"class": cls}))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        return class_fraction(prompt.meta["class"], completion)


class CharClassTurnsTask(TextTurnsTask):
    name = "charclass_turns"

    def __init__(self, turns: int = 2, preamble: str = ""):
        if turns < 1:
            raise ValueError(f"charclass_turns needs turns >= 1, got {turns}")
        self.turns = int(turns)
        self.preamble = str(preamble)

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            classes = [rng.choice(sorted(CLASSES)) for _ in range(self.turns)]
            out.append(Prompt(f"{self.preamble}write {classes[0]}:", {"classes": classes}))
        return out

    def env_response(self, prompt: Prompt, replies: list[str]) -> str | None:
        classes = prompt.meta["classes"]
        if len(replies) >= len(classes):
            return None
        verdict = "ok" if class_fraction(classes[len(replies) - 1], replies[-1]) >= 0.5 else "no"
        return f" {verdict}. write {classes[len(replies)]}:"

    def reward(self, prompt: Prompt, replies: list[str]) -> float:
        classes = prompt.meta["classes"]
        if len(replies) != len(classes):
            raise ValueError(f"{len(replies)} replies for {len(classes)} turns")
        return sum(class_fraction(c, r) for c, r in zip(classes, replies)) / len(classes)
