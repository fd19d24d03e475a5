"""Chat messages -> token ids, prefix-stable across turns (for token-in/token-out multi-turn).

A multi-turn rollout keeps one token sequence: the model's sampled tokens stay
exactly as sampled, and each new turn only *appends* tokens for the messages the
environment added (plus the generation prompt). So a format renders the first
prompt (`prompt_ids`) and then continuations (`continuation_ids`), never the
whole conversation again: re-tokenizing decoded text could split the sampled
tokens differently, and the trainer would then score tokens the engine never
produced.

* `PlainChat`: `role: content` lines, generation prompt `assistant:`; works with
  any tokenizer (the tiny test tokenizers have no chat template), but has no tools.
* `TemplateChat`: the tokenizer's own chat template. The continuation is the
  text the template puts after the assistant's reply (its end-of-turn marker)
  plus the rendering of the new messages and the generation prompt, found by
  rendering the conversation with and without them. Templates that re-write
  history (drop reasoning, trim content) are refused with the reason. A reply with
  tool calls is rendered from its parsed calls only where that gives back the sampled
  text exactly (`renders_verbatim`; `tools/parsing.py` keeps the raw text otherwise).

Messages are verifiers/OpenAI-style: dicts or objects with `role` and `content`
(a string or a list of text parts), normalized by `message_dict`; an assistant
message may carry `tool_calls` and a tool message its `tool_call_id`, which only a
chat template can render (`TemplateChat`, with the tools' definitions). Images are
not supported.
"""

from __future__ import annotations

from typing import Any


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"only text message content is supported, got a {kind!r} part")
        texts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(texts)


def message_role_text(message: Any) -> tuple[str, str]:
    """(role, text) of a message without tool calls, given as a dict or an object with `role` and `content`."""
    if _get(message, "tool_calls"):
        raise ValueError("tool calls are not supported by moerl's plain chat format")
    return str(_get(message, "role")), _text(_get(message, "content"))


def _tool_call_dict(call: Any) -> dict:
    """A tool call as chat templates take it: OpenAI's nesting, arguments as the text the model wrote."""
    fn = _get(call, "function")
    name, arguments = (_get(fn, "name"), _get(fn, "arguments")) if fn is not None else \
        (_get(call, "name"), _get(call, "arguments"))
    return {"id": str(_get(call, "id")), "type": "function", "function": {"name": str(name), "arguments": arguments}}


def message_dict(message: Any) -> dict:
    """A message as a plain dict: role, text content, and its tool calls or tool call id where it has them."""
    out = {"role": str(_get(message, "role")), "content": _text(_get(message, "content"))}
    if _get(message, "tool_calls"):
        out["tool_calls"] = [_tool_call_dict(c) for c in _get(message, "tool_calls")]
    if _get(message, "tool_call_id") is not None:
        out["tool_call_id"] = str(_get(message, "tool_call_id"))
    return out


class PlainChat:
    """`role: content` per line; the model writes after `assistant:`. No tools."""

    name = "plain"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _ids(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first).input_ids)

    @staticmethod
    def _lines(messages: list[dict], tools: list[dict] | None) -> str:
        if tools:
            raise ValueError("the plain chat format cannot declare tools; use chat_format = 'template' with a "
                             "tokenizer whose chat template renders tools")
        return "".join("{}: {}\n".format(*message_role_text(m)) for m in messages)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self._ids(self._lines(messages, tools) + "assistant:", first=True)

    def continuation_ids(self, history: list[dict], new: list[dict], last_completion_ids: list[int],
                         tools: list[dict] | None = None, reply_text: str | None = None) -> list[int]:
        """Tokens after the model's last reply: close its line, the new messages, the generation prompt."""
        return self._ids("\n" + self._lines(new, tools) + "assistant:")


class TemplateChat:
    """The tokenizer's chat template, rendered once and then extended turn by turn."""

    name = "template"

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use chat_format = 'plain'")
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return list(self.tokenizer(self._render(messages, True, tools), add_special_tokens=False).input_ids)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token the template closes an assistant turn with (a tool-calling turn stops there), if any."""
        probe = [{"role": "user", "content": "x"}]
        asked = self._render(probe, True, None)
        replied = self._render(probe + [{"role": "assistant", "content": "y"}], False, None)
        close = replied[len(asked) + 1:] if replied.startswith(asked + "y") else ""
        ids = self.tokenizer(close, add_special_tokens=False).input_ids if close else []
        return (ids[0],) if ids and ids[0] in set(self.tokenizer.all_special_ids) else ()

    def renders_verbatim(self, history: list[dict], reply: dict, text: str, tools: list[dict] | None = None) -> bool:
        """Whether the template renders `reply` (the assistant's message after `history`) as exactly `text`,
        the text the model sampled: a parsed tool call may only stand for the tokens it was parsed from."""
        return self._render(history + [reply], False, tools).startswith(self._render(history, True, tools) + text)

    def continuation_ids(self, history: list[dict], new: list[dict], last_completion_ids: list[int],
                         tools: list[dict] | None = None, reply_text: str | None = None) -> list[int]:
        """Tokens after the model's last reply (`history[-1]`; `reply_text` is the text it sampled, by default
        its content): the template's end of that turn, the new messages, the generation prompt."""
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("a continuation follows an assistant reply")
        asked = self._render(history[:-1], True, tools)
        replied = self._render(history, False, tools)
        reply = history[-1]["content"] if reply_text is None else reply_text
        if not replied.startswith(asked + reply):
            at = next((i for i, (a, b) in enumerate(zip(replied[len(asked):], reply)) if a != b), len(reply))
            raise ValueError("the chat template does not render the assistant's reply verbatim after its generation "
                             f"prompt (it rewrites history; from reply character {at}: sampled "
                             f"{reply[at:at + 40]!r}, rendered {replied[len(asked) + at:len(asked) + at + 40]!r}); "
                             "use chat_format = 'plain'")
        close = replied[len(asked + reply):]
        # A reply that ended with a special end-of-turn token (sampled, so already in the sequence) is not closed twice.
        if last_completion_ids and last_completion_ids[-1] in set(self.tokenizer.all_special_ids):
            last = self.tokenizer.decode([last_completion_ids[-1]])
            if close.startswith(last):
                close = close[len(last):]
        extended = self._render(history + new, True, tools)
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
