"""`moerl make-tiny-checkpoint --chat-template --warm-start-steps`: the tools config's checkpoint from the CLI."""

import json

from tests.conftest import run_moerl


def _make(*args):
    return run_moerl("make-tiny-checkpoint", "--arch", "kimi_k2", *args)


def test_chat_template_and_warm_start_from_the_command_line(tmp_path):
    out = tmp_path / "kimi"
    proc = _make("--out", str(out), "--init-scale", "0.1", "--chat-template", "kimi_k2", "--warm-start-steps", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "moerl_tiny.json").read_text())
    assert meta["chat_template"] == "kimi_k2" and meta["warm_start_steps"] == 2
    added = {t["content"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    assert {"<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>"} <= added
    assert (out / "chat_template.jinja").read_text().strip()


def test_a_warm_start_without_a_chat_template_is_refused_in_one_line(tmp_path):
    proc = _make("--out", str(tmp_path / "x"), "--warm-start-steps", "2")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "moerl make-tiny-checkpoint: error: warm_start_steps needs a chat_template and the plain layout "
        "(no block_fp8, shards, mtp)")
