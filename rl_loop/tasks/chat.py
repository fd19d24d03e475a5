"""Chat messages -> token ids, prefix-stable across turns (for token-in/token-out multi-turn).

A multi-turn rollout keeps one token sequence: the model's sampled tokens stay
exactly as sampled, and each new turn only *appends* tokens for the messages the
environment added (plus the generation prompt). So a format renders the first
prompt (`prompt_ids`) and then continuations (`continuation_ids`), never the
whole conversation again: re-tokenizing decoded text could split the sampled
tokens differently, and the trainer would then score tokens the engine never
produced.

* `PlainChat`: `role: content` lines, generation prompt `assistant:`; works with
  any tokenizer (the tiny test tokenizers have no chat template).
* `TemplateChat`: the tokenizer's own chat template. The continuation is the
  text the template puts after the assistant's reply (its end-of-turn marker)
  plus the rendering of the new messages and the generation prompt, found by
  rendering the conversation with and without them. Templates that re-write
  history (drop reasoning, trim content) are refused with the reason.

Messages are verifiers/OpenAI-style: dicts or objects with `role` and `content`
(a string or a list of text parts). Tool calls and images are not supported.
"""

from __future__ import annotations

from typing import Any


def message_role_text(message: Any) -> tuple[str, str]:
    """(role, text) of a message given as a dict or an object with `role` and `content`."""
    get = message.get if isinstance(message, dict) else lambda k, d=None: getattr(message, k, d)
    role, content = get("role"), get("content")
    if get("tool_calls"):
        raise ValueError("tool calls are not supported by moerl's chat formats")
    if content is None:
        return str(role), ""
    if isinstance(content, str):
        return str(role), content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"only text message content is supported, got a {kind!r} part")
        texts.append(part["text"] if isinstance(part, dict) else part.text)
    return str(role), "".join(texts)


class PlainChat:
    """`role: content` per line; the model writes after `assistant:`."""

    name = "plain"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _ids(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first).input_ids)

    @staticmethod
    def _lines(messages: list[tuple[str, str]]) -> str:
        return "".join(f"{role}: {text}\n" for role, text in messages)

    def prompt_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        return self._ids(self._lines(messages) + "assistant:", first=True)

    def continuation_ids(self, history: list[tuple[str, str]], new: list[tuple[str, str]],
                         last_completion_ids: list[int]) -> list[int]:
        """Tokens after the model's last reply: close its line, the new messages, the generation prompt."""
        return self._ids("\n" + self._lines(new) + "assistant:")


class TemplateChat:
    """The tokenizer's chat template, rendered once and then extended turn by turn."""

    name = "template"

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use chat_format = 'plain'")
        self.tokenizer = tokenizer

    def _render(self, messages: list[tuple[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages], tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return list(self.tokenizer(self._render(messages, True), add_special_tokens=False).input_ids)

    def continuation_ids(self, history: list[tuple[str, str]], new: list[tuple[str, str]],
                         last_completion_ids: list[int]) -> list[int]:
        if not history or history[-1][0] != "assistant":
            raise ValueError("a continuation follows an assistant reply")
        asked = self._render(history[:-1], True)
        replied = self._render(history, False)
        reply = history[-1][1]
        if not replied.startswith(asked + reply):
            raise ValueError("the chat template does not render the assistant's reply verbatim after its generation "
                             "prompt (it rewrites history); use chat_format = 'plain'")
        close = replied[len(asked + reply):]
        # A reply that ended with a special end-of-turn token (sampled, so already in the sequence) is not closed twice.
        if last_completion_ids and last_completion_ids[-1] in set(self.tokenizer.all_special_ids):
            last = self.tokenizer.decode([last_completion_ids[-1]])
            if close.startswith(last):
                close = close[len(last):]
        extended = self._render(history + new, True)
        if not extended.startswith(replied):
            raise ValueError("the chat template renders earlier turns differently once new messages follow; "
                             "use chat_format = 'plain'")
        return list(self.tokenizer(close + extended[len(replied):], add_special_tokens=False).input_ids)


def chat_format(tokenizer: Any, name: str = "auto") -> PlainChat | TemplateChat:
    """`auto`: the tokenizer's chat template when it has one, else `plain`."""
    if name == "auto":
        name = "template" if getattr(tokenizer, "chat_template", None) else "plain"
    formats = {"plain": PlainChat, "template": TemplateChat}
    if name not in formats:
        raise ValueError(f"unknown chat format {name!r}; choose auto, plain or template")
    return formats[name](tokenizer)
