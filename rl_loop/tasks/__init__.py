"""Tasks: where prompts come from and how completions are scored.

A task is a small object with `prompts(rng, n)` and `reward(prompt, completion)`
(reward in [0, 1]). Built-in tasks are registered by name in TASKS.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Prompt:
    text: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class Task(Protocol):
    name: str

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


def get_task(name: str) -> Task:
    from .charclass import CharClassTask

    tasks = {"charclass": CharClassTask}
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(tasks)}")
    return tasks[name]()
