"""Tasks: where prompts come from, how a rollout unfolds and how it is scored.

Two kinds, both selected by name with `get_task` (`rollout.task` in the config):

* a single-turn task has `prompts(rng, n)` and `reward(prompt, completion)`
  (reward in [0, 1]); the orchestrator samples one completion per sample;
* an episode task (multi-turn built-ins, `verifiers` environments) has
  `prompts(rng, n)` and `run_group(ctx, prompt, n, key, seed)`, which plays `n`
  rollouts of one prompt through a `rollouts.RolloutContext` (token-in/token-out,
  one `Conversation` per rollout, environment tokens masked out of the loss) and
  returns their `Episode`s.

Built-ins are registered in `BUILTIN`; `verifiers:<environment id>` loads a
`verifiers` environment (`tasks/verifiers_env.py`; needs `moerl[verifiers]`, so it is
imported only when asked for). What every task is made of lives in `tasks/base.py`.
"""

from __future__ import annotations

from ..tools.sandbox import SandboxLimits
from .base import Episode, EpisodeTask, Prompt, Task, TextTurnsTask, group_samples, is_episodic, turn_seed
from .charclass import CharClassTask, CharClassTurnsTask

__all__ = ["BUILTIN", "Episode", "EpisodeTask", "Prompt", "Task", "TextTurnsTask", "get_task", "group_samples",
           "is_episodic", "turn_seed"]

BUILTIN: dict[str, type] = {"charclass": CharClassTask, "charclass_turns": CharClassTurnsTask}


def get_task(name: str, args: dict | None = None, *, chat_format: str = "auto", tool_parser: str | None = None,
             sandbox: SandboxLimits | None = None) -> Task | EpisodeTask:
    """The task `name` (a built-in, or `verifiers:<environment id>`), built with keyword arguments `args`.

    For a verifiers environment `args` go to its `load_environment`, `chat_format` says how
    messages become tokens (`verifiers_env.chat_format`), and a tool environment's calls are
    parsed by vLLM's `tool_parser` and run in sandboxes with the limits `sandbox` (None: in
    the environment's own process, as verifiers runs them).
    """
    args = dict(args or {})
    if name.startswith("verifiers:"):
        from .verifiers_env import VerifiersTask

        return VerifiersTask(name.split(":", 1)[1], args, chat_format=chat_format, tool_parser=tool_parser,
                             sandbox=sandbox)
    if name not in BUILTIN:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(BUILTIN)}, or verifiers:<environment id>")
    try:
        return BUILTIN[name](**args)
    except TypeError as exc:
        raise ValueError(f"task {name!r} does not take arguments {args}: {exc}") from None
