"""The measured rates a plan runs on, each read from a benchmark's results JSON with its key.

A `Rate` carries the file and key it came from, so every figure a plan prints can be traced
to the run that measured it (and its command, recorded in the same file). Nothing here has a
default number: a missing file or key is an error naming it.

The files are the benchmarks' own (benchmarks/results/*.json). moerl ships a copy of the ones
a plan reads (`SHIPPED`, package data, so `moerl plan` works from an installed wheel);
`moerl plan --results DIR` reads fresh ones instead. After a benchmark rewrites one, copy it:
    cp benchmarks/results/{moe_block_h200,weight_sync,weight_reload,train_step_h200,long_context_h200,param_costs_h200}.json \
        rl_loop/plan/measured/
(tests/unit/test_plan_rates.py fails while the copies differ from benchmarks/results.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "measured"
MOE_BLOCK = "moe_block_h200.json"
WEIGHT_SYNC = "weight_sync.json"
WEIGHT_RELOAD = "weight_reload.json"
TRAIN_STEP = "train_step_h200.json"
LONG_CONTEXT = "long_context_h200.json"
PARAM_COSTS = "param_costs_h200.json"
# the files a plan reads, shipped in SHIPPED
READ = (MOE_BLOCK, WEIGHT_SYNC, WEIGHT_RELOAD, TRAIN_STEP, LONG_CONTEXT, PARAM_COSTS)


@dataclass(frozen=True)
class Rate:
    value: float
    unit: str
    source: str  # "file: key"

    def __str__(self) -> str:
        return f"{self.value:g} {self.unit}  [{self.source}]"


@dataclass(frozen=True)
class DSAPoint:
    """One measured DSA layer (GLM-5, fwd+bwd, one H200): time, indexer time, memory."""

    tokens: int
    ms: Rate
    indexer_ms: Rate
    dense_ms: Rate  # TorchTitan's dense MLA attention at the same size (causal SDPA)
    gib_above_inputs: Rate


def read_json(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: moerl plan reads its measured rates there "
                                f"(run the benchmark that writes it, or pass --results DIR)")
    return json.loads(path.read_text())


def _nearest(entries: list[tuple[int, dict]], tokens: int) -> tuple[int, dict]:
    """The (index, entry) measured at the token count nearest `tokens` on a log scale."""
    return min(entries, key=lambda ie: abs(math.log(ie[1]["tokens"] / tokens)))


class Rates:
    """Look-ups into the results files of one directory (each file read once)."""

    def __init__(self, results: Path = SHIPPED):
        self.results = Path(results)
        self._files: dict[str, dict] = {}

    def file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = read_json(self.results, name)
        return self._files[name]

    def moe_block_tflops(self, model: str, fp8: bool, tokens: int) -> Rate:
        """titan_ext's MoE block fwd+bwd with router replay (eager; fp8 re-quantising its weights
        every step, as in training), at the measured token count nearest `tokens`."""
        cases = [(i, c) for i, c in enumerate(self.file(MOE_BLOCK)["cases"])
                 if c["model"] == model and c["dtype"] == ("fp8" if fp8 else "bf16")
                 and c["variant"] == "eager" and c["replay"]]
        if not cases:
            raise ValueError(f"{MOE_BLOCK} has no eager replay case of {model} in {'fp8' if fp8 else 'bf16'}")
        i, c = _nearest(cases, tokens)
        return Rate(c["tflops"], "TFLOP/s", f"{MOE_BLOCK}: cases[{i}].tflops ({model}, {c['dtype']}, "
                                            f"{c['tokens']} tokens, eager, replay)")

    def dsa_points(self) -> list[DSAPoint]:
        """The DSA layer runs with all heads (64), ordered by tokens."""
        out = []
        for i, e in enumerate(self.file(MOE_BLOCK)["dsa"]):
            if "ms" not in e or "error" in e:
                continue
            key = f"{MOE_BLOCK}: dsa[{i}]"
            out.append(DSAPoint(
                tokens=e["tokens"], ms=Rate(e["ms"], "ms", f"{key}.ms"),
                indexer_ms=Rate(e["indexer_ms"], "ms", f"{key}.indexer_ms"),
                dense_ms=Rate(e["dense_ms"], "ms", f"{key}.dense_ms"),
                gib_above_inputs=Rate(e["gib_above_inputs"], "GiB", f"{key}.gib_above_inputs")))
        if len(out) < 2:
            raise ValueError(f"{MOE_BLOCK} needs DSA layer runs at two lengths (benchmarks.dsa_layer)")
        return sorted(out, key=lambda p: p.tokens)

    def moe_memory(self) -> list[dict]:
        """benchmarks.moe_memory's entries, each with its key."""
        return [dict(e, key=f"{MOE_BLOCK}: moe_memory[{i}].gib_above_inputs")
                for i, e in enumerate(self.file(MOE_BLOCK)["moe_memory"])]

    def dense_tflops(self) -> Rate:
        return Rate(self.file(MOE_BLOCK)["dense_bf16_tflops"]["mean"], "TFLOP/s",
                    f"{MOE_BLOCK}: dense_bf16_tflops.mean (8192^3 bf16 matmul)")

    def _ep_case(self, model: str, tokens: int) -> tuple[int, dict]:
        cases = [(i, dict(c, tokens=c["tokens_per_rank"])) for i, c in enumerate(self.file(MOE_BLOCK)["ep"]["cases"])
                 if c["model"] == model]
        if not cases:
            raise ValueError(f"{MOE_BLOCK} has no ep case of {model} (benchmarks.moe_ep)")
        return _nearest(cases, tokens)

    def ep_dispatch_gbps(self, model: str, tokens: int) -> Rate:
        """The EP dispatcher's dispatch+combine, fwd+bwd, per rank over NVLink (NCCL, 2 H200s)."""
        i, c = self._ep_case(model, tokens)
        return Rate(c["dispatcher_fwd_bwd_gbps"], "GB/s", f"{MOE_BLOCK}: ep.cases[{i}].dispatcher_fwd_bwd_gbps "
                                                          f"({model}, {c['tokens']} tokens/rank)")

    def nvlink_collective_gbps(self, model: str, tokens: int) -> Rate:
        """Raw NCCL all_to_all_single per rank over NVLink: the intra-node rate used for FSDP's
        all-gather / reduce-scatter and the CP gathers (no all-gather benchmark exists here)."""
        i, c = self._ep_case(model, tokens)
        return Rate(c["all_to_all_single_gbps"], "GB/s", f"{MOE_BLOCK}: ep.cases[{i}].all_to_all_single_gbps")

    def train_step(self, fp8: bool) -> tuple[str, str, int, Rate]:
        """(model, flavor, tokens per step, measured tokens/s) of benchmarks.train_step's run in
        fp8 or bf16: a whole TorchTitan training step on one H200."""
        d = self.file(TRAIN_STEP)
        name = "fp8" if fp8 else "bf16"
        run = d["runs"][name]
        model = re.search(r"--model (\S+)", run["command"]).group(1)
        return (model, d["model"]["flavor"], d["model"]["tokens_per_step"],
                Rate(run["tps_median"], "tokens/s", f"{TRAIN_STEP}: runs.{name}.tps_median"))

    def per_parameter_seconds(self) -> Rate:
        """What a step costs once per local parameter, whatever its tokens: TorchTitan's fused AdamW
        step and FSDP2's copy-in and copy-out casts, each timed alone on one H200 (benchmarks.param_costs)."""
        pieces = self.file(PARAM_COSTS)["pieces"]
        names = ("adamw_fused", "copy_in_fp32_to_bf16", "copy_out_bf16_to_fp32")
        ns = sum(pieces[n]["ns_per_parameter"] for n in names)
        return Rate(ns * 1e-9, "s per parameter",
                    " + ".join(f"{PARAM_COSTS}: pieces.{n}.ns_per_parameter" for n in names))

    def optimizer_offload_pair(self) -> tuple[str, int, Rate, Rate]:
        """(model, tokens per step, tokens/s without, tokens/s with `--titan_ext.optimizer_offload`) of
        benchmarks.long_context on Kimi-K2 `bench`: the chunked loss alone and with the offload, at the
        ladders' common length, where both train."""
        d = self.file(LONG_CONTEXT)["models"]["kimi_k2"]
        common = min(int(n) for n in d["techniques"]["none"]["runs"])
        rates = [Rate(d["techniques"][t]["runs"][str(common)]["tps_median"], "tokens/s",
                      f"{LONG_CONTEXT}: models.kimi_k2.techniques.{t}.runs.{common}.tps_median")
                 for t in ("loss_chunks", "loss_chunks+offload")]
        return "kimi_k2", common, rates[0], rates[1]

    def weight_sync_runs(self) -> list[dict]:
        """weight_sync.json's timed runs, each with its key."""
        return [dict(r, key=f"{WEIGHT_SYNC}: runs[{i}]") for i, r in enumerate(self.file(WEIGHT_SYNC)["runs"])]
