"""A short supervised warm start of a tiny checkpoint on demonstrations in its chat format.

A randomly initialised tiny model samples a well-formed tool call (ten exact tokens
in Kimi-K2's format) with probability ~0: RL alone would never see one. Real agentic RL
starts from an instruct model that has seen its format in fine-tuning; this gives the
tiny model the same kind of prior in a minute of CPU time: next-token training on
`lookup` conversations (`demonstrations`), half of which call the tool (once or
twice) and copy its answer and half of which guess. The policy then knows the format but not when the tool
pays, nor (yet) how to copy; RL on `vf_lookup` has to teach both.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def demonstrations(tokenizer, rng: random.Random, n: int, tool_rate: float = 0.5) -> list[str]:
    """`n` lookup conversations rendered by the tokenizer's chat template; `tool_rate` of them use the tool."""
    from .tasks.vf_lookup import TOOL_SPEC, code_of

    out = []
    for _ in range(n):
        key = f"k{rng.randrange(100)}"
        messages = [{"role": "user", "content": f"code of {key}?"}]
        if rng.random() < tool_rate:
            for _ in range(rng.choice((1, 2))):  # some look twice: multi-call conversations
                call = {"id": "functions.lookup:0", "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": code_of(key)}]
            messages.append({"role": "assistant", "content": code_of(key)})
        else:
            messages.append({"role": "assistant", "content": f"{rng.randrange(1000):03d}"})
        out.append(tokenizer.apply_chat_template(messages, tools=[TOOL_SPEC], tokenize=False))
    return out


def warm_start(checkpoint: str | Path, *, steps: int, dtype: str = "float32", batch: int = 16, lr: float = 3e-3,
               seed: int = 0) -> None:
    """Train the HF checkpoint in `checkpoint` for `steps` AdamW steps (in fp32) on demonstrations, and save it
    in place in `dtype`."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    if not tok.chat_template:
        raise ValueError(f"{checkpoint}: warm start needs a chat template (model.chat_template)")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        enc = tok(demonstrations(tok, rng, batch), add_special_tokens=False, return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(getattr(torch, dtype)).save_pretrained(checkpoint)
