"""`moerl rl` config: strict types, ranges, `--set` parsing and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl_loop.config import SECTIONS, ConfigError, RLConfig, TrainConfig, describe, parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_kimi_k2.toml")


def load(*sets: str) -> RLConfig:
    return RLConfig.from_toml(CONFIG, parse_overrides(list(sets)))


def test_readme_overrides_keep_their_types():
    cfg = load("train.replay=false", "train.steps=10", "train.lr=1e-4", "rollout.task_args={turns = 2}",
               "inference.endpoints=['http://h:1']", "rollout.temperature=1")
    assert cfg.train.replay is False and cfg.train.steps == 10 and cfg.train.lr == 1e-4
    assert cfg.rollout.task_args == {"turns": 2} and cfg.inference.endpoints == ["http://h:1"]
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert load("rollout.task_args.turns=3").rollout.task_args == {"turns": 3}


def test_text_fields_take_the_text_as_given():
    """`--set key=` is the empty string (no pinning for the cpus keys); '0' stays a core list, not the integer 0."""
    cfg = load("train.cpus=", "inference.cpus=", "model.checkpoint=")
    assert (cfg.train.cpus, cfg.inference.cpus, cfg.model.checkpoint) == ("", "", "")
    assert load("train.cpus=0").train.cpus == "0"
    assert load("rollout.task=123").rollout.task == "123"


@pytest.mark.parametrize("item, message", [
    ("train.steps=10.9", "train.steps: Input should be a valid integer, got 10.9"),
    ('train.steps="10"', "train.steps: Input should be a valid integer, got '10'"),
    ("train.steps=true", "train.steps: Input should be a valid integer, got True"),
    ("train.steps=", "train.steps: Input should be a valid integer, got ''"),
    ("train.steps=0", "train.steps: Input should be greater than or equal to 1, got 0"),
    ("train.lr=nan", "train.lr: Input should be a finite number, got nan"),
    ("train.lr=-inf", "train.lr: Input should be a finite number, got -inf"),
    ("train.lr=0", "train.lr: Input should be greater than 0, got 0"),
    ("train.max_ratio=1", "train.max_ratio: Input should be greater than 1, got 1"),
    ("train.replay=1", "train.replay: Input should be a valid boolean, got 1"),
    ("inference.base_port=70000", "inference.base_port: Input should be less than or equal to 65535, got 70000"),
    ("model.inference_dtype=fp16", "model.inference_dtype: Input should be 'bfloat16' or 'float32', got 'fp16'"),
    ("rollout.task_args=3", "rollout.task_args: must be a table, got 3"),
    ("train.cpus=0-x", "train.cpus: bad CPU list '0-x': expected e.g. '0-3,6'"),
    ("train.stesp=3", "train.stesp: unknown key (known: " + ", ".join(TrainConfig.__pydantic_fields__) + ")"),
    ("trian.steps=3", "trian: unknown key (known: run_dir, seed, model, inference, rollout, train)"),
])
def test_bad_values_are_one_line_errors_naming_the_key(item, message):
    with pytest.raises(ConfigError) as e:
        load(item)
    assert str(e.value) == message


def test_context_parallel_must_divide_the_trainer_and_fit_the_model():
    assert load("train.nproc=4", "train.context_parallel=2").train.context_parallel == 2
    with pytest.raises(ConfigError) as e:
        load("train.nproc=3", "train.context_parallel=2")
    assert str(e.value) == ("train: context_parallel = 2 does not divide nproc = 3: the trainer's processes are "
                            "data parallel x context parallel; set nproc to a multiple")
    with pytest.raises(ConfigError) as e:
        load("train.nproc=2", "train.context_parallel=2", "model.arch=qwen3_moe")
    assert str(e.value) == ("train.context_parallel = 2: context parallel runs titan_ext's MLA models (glm5, kimi_k2), "
                            "not 'qwen3_moe' (model.arch); set train.context_parallel = 1")


def test_tensor_parallel_sizes_managed_replicas_only():
    assert load("inference.tensor_parallel=2").inference.tensor_parallel == 2
    with pytest.raises(ConfigError) as e:
        load("inference.replicas=0", 'inference.endpoints=["http://10.0.0.5:8000"]', "inference.tensor_parallel=2")
    assert str(e.value) == ("inference: inference.tensor_parallel = 2 sizes managed replicas; with inference.endpoints "
                            "their own servers set it: leave it at 1")


def test_prefill_and_decode_replicas_replace_replicas_and_need_the_pool():
    from rl_loop.disagg import replica_roles

    pd = ("inference.prefill_replicas=1", "inference.decode_replicas=2", 'inference.kv_pool="mooncake"')
    c = load(*pd).inference
    assert c.replicas == 3
    assert replica_roles(c) == [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
    assert replica_roles(load().inference) == [("r0", "both"), ("r1", "both")]
    assert load(*pd, 'inference.router="llmd"').inference.replicas == 3  # llm-d's P/D profiles pick both
    for bad, message in [
        (pd[:1] + pd[2:], "inference: inference.prefill_replicas = 1 and decode_replicas = 0: disaggregation needs "
                          "at least one of each (or 0 and 0)"),
        (pd[:2], "inference: inference.prefill_replicas hand the prompt's KV to the decode replicas through the "
                 "Mooncake pool: set inference.kv_pool = 'mooncake'"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(*bad)
        assert str(e.value) == message


def test_core_lists_must_name_cores_of_this_machine():
    n = os.cpu_count()
    assert load(f"train.cpus=0-{n - 1}").train.cpus == f"0-{n - 1}"
    with pytest.raises(ConfigError, match=rf"train.cpus: '0,{n}' names core {n}; this machine has {n} cores"):
        load(f"train.cpus=0,{n}")


def test_set_needs_key_and_value():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["train.steps"])


def test_config_file_is_checked_like_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 2.5\n")
    with pytest.raises(ConfigError, match=r"^train.steps: Input should be a valid integer, got 2.5$"):
        RLConfig.from_toml(path)
    path.write_text("[train]\nsteps 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}: Expected '=' after a key .*\(at line 2, column 7\)$"):
        RLConfig.from_toml(path)
    path.write_text("seed = 3\n[train]\nsteps = 2\n")
    cfg = RLConfig.from_toml(path)
    assert cfg.seed == 3 and cfg.train.steps == 2 and cfg.train.lr == RLConfig().train.lr


def test_help_lists_every_key_with_default_type_and_meaning():
    text = describe()
    for section in ("model", "inference", "rollout", "train"):
        assert f"[{section}]" in text
    assert "  steps = 40  # optimizer steps [int, >= 1]" in text
    assert "  max_ratio = 2.0  # " in text and "[float, > 1]" in text
    assert "(--set train.cpus=): no pinning" in text
    assert "['bfloat16' | 'float32']" in text
    keys = [line.split("=")[0].strip() for line in text.splitlines() if not line.startswith("[")]
    assert keys == [*(k for k in RLConfig.__pydantic_fields__ if k not in SECTIONS),
                    *(k for cls in SECTIONS.values() for k in cls.__pydantic_fields__)]


def test_cli_reports_a_bad_value_in_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "rl_loop", "rl", "--config", CONFIG, "--set", "train.steps=10.9"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == "moerl rl: error: train.steps: Input should be a valid integer, got 10.9\n"


def test_cli_refuses_max_tokens_beyond_the_checkpoint_context_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl_loop", "rl", "--config", CONFIG, "--set", "rollout.max_tokens=100000",
                           "--set", f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("moerl rl: error:")]
    assert error == [f"moerl rl: error: rollout.max_tokens 100000 leaves no room for a prompt in the checkpoint's "
                     f"context of 8192 tokens (max_position_embeddings in {tmp_path / 'run/init/config.json'}); "
                     f"lower rollout.max_tokens below 8192"]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "trainer").exists() and not (tmp_path / "run" / "replicas").exists()


def test_fp8_experts_with_torchtitans_dispatcher_are_refused_when_the_config_is_checked(tmp_path):
    """titan_ext's rule (`builder.check_moe_options`, what `torchtitan train` refuses), applied by
    the config check: one line, exit 2, before the tiny checkpoint, a server or the trainer exists."""
    assert load("train.fp8=true", "train.dispatcher=lean").train.fp8
    assert load("train.fp8=true", "train.dispatcher=deepep").train.dispatcher == "deepep"
    proc = subprocess.run([sys.executable, "-m", "rl_loop", "rl", "--config", CONFIG, "--set", "train.fp8=true",
                           "--set", "train.dispatcher=torchtitan", "--set", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == ("moerl rl: error: train: fp8 = true with dispatcher = 'torchtitan': fp8 experts need "
                           "the lean or deepep dispatcher, not torchtitan's\n")
    assert not (tmp_path / "run").exists()


def test_checking_a_config_without_fp8_imports_no_torchtitan():
    """`moerl --help` and `moerl rl --help` build the parser from this module: it stays light."""
    code = ("import sys; from rl_loop.config import RLConfig, describe; describe(); RLConfig(); "
            "print(sorted(m for m in ('torch', 'torchtitan', 'titan_ext') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
