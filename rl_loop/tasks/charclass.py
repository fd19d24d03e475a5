"""A verifiable toy task a tiny random MoE learns on CPU in minutes.

The prompt names a character class ("write digits:" / "write letters:"); the
reward is the fraction of the completion's non-space characters in that class.
A random policy already scores 0.2-0.4 (the tiny tokenizer has many digit and
letter tokens), so every group has reward variance from the first step, and the
policy must condition on the prompt to do well on both classes.
"""

from __future__ import annotations

import random

from . import Prompt

CLASSES = {
    "digits": str.isdigit,
    "letters": lambda c: c.isascii() and c.isalpha(),
}


class CharClassTask:
    name = "charclass"

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            cls = rng.choice(sorted(CLASSES))
            out.append(Prompt(f"write {cls}:", {"class": cls}))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        chars = [c for c in completion if not c.isspace()]
        if not chars:
            return 0.0
        test = CLASSES[prompt.meta["class"]]
        return sum(1 for c in chars if test(c)) / len(chars)
