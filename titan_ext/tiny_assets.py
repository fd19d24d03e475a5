"""The tiny tokenizer and text corpus every CPU-sized model in moerl shares.

Nothing may be downloaded, so the tokenizer is a byte-level BPE trained here on a
built-in corpus. It lives in titan_ext because the `tiny` flavors' vocabulary is
this tokenizer's size and the trainer's default data is this corpus; the RL loop's
tiny checkpoints reuse both.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512


def corpus() -> list[str]:
    words = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()
    lines = []
    for i in range(2000):
        a, b = (i * 7919) % 1000, (i * 104729) % 1000
        lines.append(f"{a} + {b} = {a + b}. {words[i % len(words)]} {words[(i * 3) % len(words)]} answer: {a * b % 97}")
    return lines


def train_tokenizer(out_dir: Path, *, special_tokens: tuple[str, ...] = (), extra_corpus: tuple[str, ...] = (),
                    chat_template: str | None = None) -> None:
    """Byte-level BPE with VOCAB_SIZE entries, saved as an HF fast tokenizer.

    `special_tokens` (a chat format's markers) take one id each after the three base ones,
    `extra_corpus` adds training text (so the format's frequent strings get merges), and
    `chat_template` is saved with the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>", *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*corpus(), *extra_corpus], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
                                   additional_special_tokens=list(special_tokens) or None)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
