"""A sampled assistant turn -> tool calls, by vLLM's own tool parser for the model family.

moerl generates token-in/token-out on `/v1/completions`, so no server parses tool
calls for it; this module does what vLLM's chat endpoint does with a finished reply:
`ToolParserManager.get_tool_parser(name)(tokenizer).extract_tool_calls(text, request)`
with a request that declares the tools. `rollout.tool_parser` names the parser;
`auto` takes it from the model family (`DEFAULT_PARSERS`).

A turn is *malformed* (`ParsedTurn.malformed` says why) when the text has the
family's tool-call marker but no call could be parsed, a call names a tool that was
not declared or its arguments are not a JSON object, or the chat template would not
render the parsed calls back as the exact sampled text. A malformed turn is an
ordinary outcome: its calls are dropped, the reply stays plain text, and the
environment scores it (a `ToolEnv` ends the rollout there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PARSERS = {"kimi_k2": "kimi_k2", "glm5": "glm47"}  # model.arch -> vLLM tool parser


def tool_metrics(counters: dict) -> dict:
    """A step's tool-use metrics from its rollout counters (none for a task without tools):
    `tool_use_rate`, the fraction of rollouts with a well-formed tool call, and the counts."""
    if not counters.get("rollouts"):
        return {}
    return {"tool_use_rate": counters.get("tool_rollouts", 0) / counters["rollouts"],
            "tool_calls": counters.get("tool_calls", 0), "malformed_tool_calls": counters.get("malformed_tool_calls", 0)}


def _markers(name: str) -> tuple[str, ...]:
    """The texts that open a tool call in the parser's format (their presence without a call is malformed)."""
    if name == "kimi_k2":
        from vllm.parser.kimi_k2 import TOOL_CALL_START, TOOL_SECTION_START

        return TOOL_SECTION_START, TOOL_CALL_START
    if name in ("glm45", "glm47"):
        from vllm.parser.glm47_moe import TOOL_CALL_START

        return (TOOL_CALL_START,)
    return ()


@dataclass
class ParsedTurn:
    """One assistant reply: its text content, the well-formed tool calls, and why it is malformed (or None)."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI form: {id, type, function: {name, arguments}}
    malformed: str | None = None

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ToolCallParser:
    """vLLM's tool parser `name` for `tokenizer`, with the rollout's tool definitions (OpenAI form)."""

    def __init__(self, name: str, tokenizer: Any, tools: list[dict]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            self._cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"rollout.tool_parser = {name!r} is not a vLLM tool parser; choose one of "
                             f"{ToolParserManager.list_registered()}") from None
        self.name, self.tokenizer, self.tools = name, tokenizer, tools
        self.tool_names = {t["function"]["name"] for t in tools}
        self.markers = _markers(name)
        self.request = ChatCompletionRequest(model="moerl", messages=[], tools=tools)

    def parse(self, text: str) -> ParsedTurn:
        """The reply `text` (decoded with special tokens) as vLLM's chat endpoint would return it."""
        info = self._cls(self.tokenizer, self.tools).extract_tool_calls(text, self.request)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in (info.tool_calls if info.tools_called else [])]
        if not calls:
            if any(m in text for m in self.markers):
                return ParsedTurn(text, [], "a tool-call marker but no call the parser could read")
            return ParsedTurn(text)
        for c in calls:
            name, args = c["function"]["name"], c["function"]["arguments"]
            if name not in self.tool_names:
                return ParsedTurn(text, [], f"a call to {name!r}, which is not one of the tools {sorted(self.tool_names)}")
            try:
                ok = isinstance(json.loads(args), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                return ParsedTurn(text, [], f"the arguments of {name!r} are not a JSON object: {args[:80]!r}")
        return ParsedTurn(info.content or "", calls)
