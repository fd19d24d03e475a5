"""Chat templates in a model family's real format, for the tiny checkpoints (which have no template of their own).

Agentic rollouts need what a real checkpoint ships: special tokens for turns and tool
calls, and a chat template that renders tool declarations, tool calls and tool results
the way the family's vLLM tool parser reads them. `KIMI_K2` follows the layout of
Kimi-K2-Instruct's template (`<|im_user|>user<|im_middle|>...<|im_end|>`, tools declared
in a `tool_declare` system turn, calls in a `<|tool_calls_section_begin|>` section with
`functions.<name>:<index>` ids, results as `## Return of <id>`), written here for the
tiny tokenizer; it leaves out Kimi's default system prompt, which would only lengthen
every tiny sequence. `train_tokenizer(..., special_tokens=KIMI_K2.special_tokens)`
gives each marker one token id, as in the real vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    special_tokens: tuple[str, ...]
    template: str
    tool_parser: str  # vLLM's tool parser for this format (ToolParserManager name)


KIMI_K2 = ChatTemplate(
    name="kimi_k2",
    special_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    template=(
        "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
        "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
        "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}{{ '\\n' }}{%- endif -%}"
        "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
        "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}<|tool_calls_section_begin|>"
        "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
        "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
        "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
        "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
        "<|im_end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    ),
    tool_parser="kimi_k2",
)

TEMPLATES = {t.name: t for t in (KIMI_K2,)}


def get_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def sample_conversations(template: ChatTemplate, n: int = 400) -> list[str]:
    """Tool-calling conversations rendered in `template`, as tokenizer training text: the tiny tokenizer
    then merges the format's frequent strings (the tool declaration, call ids) instead of spelling them
    out byte by byte."""
    import json

    from jinja2 import Environment

    from .tasks.vf_lookup import TOOL_SPEC, code_of

    env = Environment()
    env.filters["tojson"] = json.dumps  # as transformers' chat templates have it (no HTML escaping)
    render = env.from_string(template.template).render
    out = []
    for i in range(n):
        key = f"k{i % 100}"
        call = {"id": "functions.lookup:0", "type": "function",
                "function": {"name": "lookup", "arguments": f'{{"key": "{key}"}}'}}
        messages = [{"role": "user", "content": f"code of {key}?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": code_of(key)},
                    {"role": "assistant", "content": code_of(key)}]
        out.append(render(messages=messages, tools=[TOOL_SPEC], add_generation_prompt=False))
    return out
