"""The longest sequence one GPU trains, with titan_ext's memory techniques off and on, side by side.

Each case is one `torchtitan train --extension titan_ext --model M --flavor bench` run (full width,
4 layers, 16 experts, fp8 experts; `benchmarks.train_step.train`; M is kimi_k2, or glm5 with
`--model glm5`) at one sequence length with one set of flags:

* ``none``: whole-sequence logits, AdamW state on the GPU, TorchTitan's default (selective) AC;
* ``loss_chunks``: + `--titan_ext.loss_chunks` (chunks of at most 8192 positions);
* ``loss_chunks+offload``: + `--titan_ext.optimizer_offload`;
* ``loss_chunks+offload+full_ac``: + TorchTitan's full activation checkpointing, with the
  checkpointed layer inputs in host memory (`--titan_ext.activation_offload`).

Each technique climbs its own ladder of lengths and stops at its first failure, so the JSON holds
the longest length that trained and the one that did not (with the reason: out of memory, or the
log's last error). At the common length (the ladder's first) the tokens/s of every technique are
measured in the same run: that is each one's cost. Peak memory is TorchTitan's logged peak.

    python -m benchmarks.long_context --out benchmarks/results/long_context_h200.json
    python -m benchmarks.long_context --model glm5 --merge --out benchmarks/results/long_context_h200.json

Each model's results are under `models.<model>`.
"""

from __future__ import annotations

import argparse
import re

from .gpu_bench import ResultsFile, run_info
from .train_step import ROOT, train

CHUNK_TOKENS = 8192
TECHNIQUES = {
    "none": ([], (24576, 32768)),
    "loss_chunks": (["loss_chunks"], (24576, 49152, 65536)),
    "loss_chunks+offload": (["loss_chunks", "--titan_ext.optimizer_offload"], (24576, 65536, 98304)),
    "loss_chunks+offload+full_ac": (["loss_chunks", "--titan_ext.optimizer_offload", "--titan_ext.activation_offload",
                                     "activation-checkpoint:full"], (24576, 98304, 131072)),
}


def flags(names: list[str], seq_len: int) -> tuple[str, ...]:
    """The command-line flags of a technique at `seq_len` (the AC subcommand last, as tyro parses it)."""
    out = []
    for name in names:
        out += ["--titan_ext.loss_chunks", str(max(1, seq_len // CHUNK_TOKENS))] if name == "loss_chunks" else [name]
    return tuple(sorted(out, key=lambda f: f.startswith("activation-checkpoint")))


def outcome(run: dict) -> str:
    if run["returncode"] == 0 and run["tps_median"]:
        return "trained"
    tail = run.get("log_tail", "")
    if re.search(r"OutOfMemoryError|CUDA out of memory", tail):
        return "out of memory"
    return "failed: " + (tail.strip().splitlines() or ["no log"])[-1][:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/long_context_h200.json")
    ap.add_argument("--steps", type=int, default=4, help="steps per run; steps 1-2 are warm-up (default 4)")
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--techniques", nargs="+", default=list(TECHNIQUES), choices=list(TECHNIQUES))
    ap.add_argument("--model", choices=("kimi_k2", "glm5"), default="kimi_k2",
                    help="the model whose bench flavor trains (default kimi_k2)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other models' and techniques' results in --out (a run split over device sessions)")
    args = ap.parse_args()

    out = ResultsFile(ROOT / args.out)
    models = out.read().get("models", {}) if args.merge else {}
    kept = {k: v for k, v in models.get(args.model, {}).get("techniques", {}).items() if k not in args.techniques}
    res = models[args.model] = {**run_info("benchmarks.long_context"), "model": f"{args.model} bench, fp8 experts, batch 1",
                                "techniques": kept}
    whole = {"loss_chunk_tokens": CHUNK_TOKENS, "models": models}
    for name in args.techniques:
        names, ladder = TECHNIQUES[name]
        tech = res["techniques"][name] = {"runs": {}, "longest_trained": None, "first_failed": None}
        for seq_len in ladder:
            run = train("bench", args.steps, seq_len, 1, True, args.timeout_s, flags(names, seq_len), model=args.model)
            run["outcome"] = outcome(run)
            tech["runs"][str(seq_len)] = run
            print(args.model, name, seq_len, run["outcome"], run["tps_median"], run["peak_memory"], flush=True)
            if run["outcome"] != "trained":
                tech["first_failed"] = seq_len
                out.update(whole)
                break
            tech["longest_trained"] = seq_len
            out.update(whole)  # a run cut short keeps what it measured
    common = str(min(ladder[0] for _, ladder in TECHNIQUES.values()))  # every ladder starts there
    base = res["techniques"].get("none", {}).get("runs", {}).get(common, {}).get("tps_median")
    if base:
        res["tokens_per_s_vs_none_at_" + common] = {
            name: round(t["runs"][common]["tps_median"] / base, 3)
            for name, t in res["techniques"].items() if t["runs"].get(common, {}).get("tps_median")}
    out.update(whole)
    print({k: v for k, v in res.items() if k != "techniques"})


if __name__ == "__main__":
    main()
