"""What every task is made of: prompts, the two task protocols, episodes and their samples.

The registry that picks a task by name (`rl_loop.tasks.get_task`) and the tasks themselves
(`charclass.py`, `verifiers_env.py`) build on this module; it knows none of them.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..batch import Sample
    from ..rollouts import Conversation, RolloutContext


@dataclass(frozen=True)
class Prompt:
    text: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class Task(Protocol):
    name: str

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


@dataclass
class Episode:
    """One finished rollout of an episode task: its token sequence and reward (or why it failed)."""

    conversation: Conversation | None
    reward: float
    error: str | None = None

    def sample(self, group: int) -> Sample:
        from ..batch import Sample

        conv = self.conversation
        if conv is None:  # failed before the first turn: nothing to train on, rejected when packed
            return Sample([], [], [], self.reward, group, error=self.error or "no turn was generated")
        s = conv.sample(self.reward, group)
        s.error = self.error
        return s


class EpisodeTask(Protocol):
    name: str

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]: ...

    async def run_group(self, ctx: RolloutContext, prompt: Prompt, n: int, key: str, seed: int) -> list[Episode]: ...


def group_samples(episodes: list[Episode], group: int) -> list[Sample]:
    """The samples of one group. They all carry the group's oldest policy version (a turn re-sent to a
    lagging replica makes the whole group that old), so staleness drops whole groups, as for single turns."""
    samples = [ep.sample(group) for ep in episodes]
    versions = [ep.conversation.policy_version for ep in episodes
                if ep.conversation is not None and ep.conversation.policy_version is not None]
    for s in samples:
        s.policy_version = min(versions) if versions else 0
    return samples


def is_episodic(task: Any) -> bool:
    return callable(getattr(task, "run_group", None))


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """Sampling seed of one turn of one sample of a group (each sample is its own request)."""
    return seed + 7919 * sample + 104729 * turn


class TextTurnsTask:
    """Base of built-in multi-turn tasks whose environment speaks plain text.

    Subclasses give `prompts`, `env_response(prompt, replies)` (the text appended
    after the model's latest reply, or None when the episode is over) and
    `reward(prompt, replies)`. The prompt is tokenized once; every environment
    response is tokenized on its own and appended to the sequence (loss-mask 0).
    """

    name = "text_turns"

    def env_response(self, prompt: Prompt, replies: list[str]) -> str | None:
        raise NotImplementedError

    def reward(self, prompt: Prompt, replies: list[str]) -> float:
        raise NotImplementedError

    async def run_group(self, ctx: RolloutContext, prompt: Prompt, n: int, key: str, seed: int) -> list[Episode]:
        from ..rollouts import Conversation

        async def one(i: int) -> Episode:
            conv = Conversation(ctx.encode(prompt.text, first=True))
            replies: list[str] = []
            while True:
                comp = await ctx.turn(conv, key, turn_seed(seed, i, len(replies)))
                replies.append(ctx.tokenizer.decode(comp.completion_ids))
                text = self.env_response(prompt, replies)
                if text is None:
                    return Episode(conv, self.reward(prompt, replies))
                conv.append(ctx.encode(text))

        return list(await asyncio.gather(*(one(i) for i in range(n))))
