"""`moerl rl` configuration: typed dataclasses read from TOML and `--set KEY=VALUE`.

Every knob has a type, a default, a range where one makes sense and a help text
(shown by `moerl rl --help`); pydantic checks them. Types are strict: a typo or a
wrong type in a config must not quietly run something else (10.9 steps is an
error, not 10 steps), unknown sections or keys are errors, and floats must be
finite.

`--set` values: a text field (`str`) takes the text as given, so `--set train.cpus=`
sets the empty string; any other field reads it as a TOML value (`10`, `1e-3`,
`false`, `[...]`, `{turns = 2}`), and text that is no TOML value stays text (and is
then refused by a field that is not text).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter
from pydantic import ValidationError, model_validator
from pydantic.dataclasses import dataclass

from .placement import parse_cpus

CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


class ConfigError(ValueError):
    """A config that does not validate; the message is one line naming the key."""


def knob(default, help: str, **constraints):
    """A config field: its default, its help text and pydantic constraints (ge, gt, ...)."""
    if callable(default):
        return Field(default_factory=default, description=help, **constraints)
    return Field(default, description=help, **constraints)


def _cores_on_this_machine(spec: str) -> str:
    if spec in ("", "auto"):
        return spec
    n = os.cpu_count() or 1
    highest = max(parse_cpus(spec))
    if highest >= n:
        raise ValueError(f"{spec!r} names core {highest}; this machine has {n} cores (0-{n - 1})")
    return spec


# '' (no pinning), 'auto', or a core list such as '0-3,6' within os.cpu_count()
CpuList = Annotated[StrictStr, AfterValidator(_cores_on_this_machine)]
Port = Annotated[StrictInt, Field(ge=1, le=65535)]


@dataclass(config=CONFIG)
class ModelConfig:
    arch: StrictStr = knob("kimi_k2", "titan_ext model (kimi_k2, glm5) the trainer runs")
    flavor: StrictStr = knob("tiny", "titan_ext flavor; `tiny` makes its own random checkpoint")
    checkpoint: StrictStr = knob("", "HF checkpoint directory to start from; '' (--set model.checkpoint=): make a "
                                     "tiny one in the run dir")
    init_scale: StrictFloat = knob(0.1, "weight std of the generated tiny checkpoint (0.1: routing matters)", gt=0)
    inference_dtype: Literal["bfloat16", "float32"] = knob("bfloat16", "dtype of the vLLM replicas")
    chat_template: Literal["", "kimi_k2"] = knob(
        "", "the generated tiny checkpoint's chat template and special tokens, in a family's real format "
            "(rl_loop/chat_templates.py; tool environments need one); '': none")
    warm_start_steps: StrictInt = knob(
        0, "supervised steps on demonstrations in the chat template's format before RL (rl_loop/warm_start.py: a "
           "random tiny model never samples a well-formed tool call); 0: none", ge=0)


@dataclass(config=CONFIG)
class InferenceConfig:
    replicas: StrictInt = knob(2, "vLLM replicas to start as managed subprocesses (0: use `endpoints`)", ge=0)
    endpoints: list[StrictStr] = knob(list, "existing vLLM/llm-d base URLs, e.g. ['http://10.0.0.5:8000']")
    base_port: Port = knob(18400, "first port of the managed replicas")
    max_num_seqs: StrictInt = knob(64, "vLLM --max-num-seqs of each managed replica", ge=1)
    kv_cache_gib: StrictFloat = knob(
        1.0, "KV cache of each managed replica (vLLM --kv-cache-memory-bytes); CPU RAM", gt=0)
    enforce_eager: StrictBool = knob(True, "start managed replicas with --enforce-eager (no compile warm-up)")
    tensor_parallel: StrictInt = knob(
        1, "vLLM --tensor-parallel-size of each managed replica; the sharded weight lanes send each of its "
           "workers only its slices", ge=1)
    request_timeout_s: StrictFloat = knob(120.0, "per-request timeout; a replica that times out is marked down", gt=0)
    router: Literal["embedded", "llmd"] = knob(
        "embedded", "who picks each request's replica: 'embedded' (router_ext's formula in this process) or 'llmd' "
                    "(a running llm-d endpoint picker at llmd_address, asked over ext_proc as Envoy does)")
    llmd_address: StrictStr = knob("127.0.0.1:9002", "host:port of the llm-d EPP's ext_proc gRPC port (router = 'llmd')",
                                   pattern=r"^[^:\s]+:[0-9]{1,5}$")
    llmd_retry_s: StrictFloat = knob(
        120.0, "router = 'llmd': how long a request keeps asking again (with backoff) while the EPP answers 429, "
               "i.e. every replica is paused", gt=0)
    cpus: CpuList = knob(
        "auto",
        "CPU cores of the managed replicas, e.g. '2-3' (split between replicas when there are enough); "
        "'auto': the cores the trainer does not get; '' (--set inference.cpus=): no pinning",
    )
    kv_pool: Literal["off", "mooncake"] = knob(
        "off", "'mooncake': the managed replicas pool KV (and its routing rows) in one Mooncake store, whose "
               "mooncake_master moerl starts and stops; a prefix computed on one replica is reused by every other")
    kv_pool_host: StrictStr = knob("127.0.0.1", "address the mooncake_master's RPC and metrics servers listen on",
                                   min_length=1)
    kv_pool_rpc_port: Port = knob(18551, "mooncake_master RPC port")
    kv_pool_metrics_port: Port = knob(18552, "mooncake_master metrics port")
    kv_pool_segment_gib: StrictFloat = knob(0.25, "memory each managed replica lends the KV pool (CPU RAM)", gt=0)
    prefill_replicas: StrictInt = knob(
        0, "prefill/decode disaggregation: managed replicas (p0, p1, ...) that only compute prompts and hand their "
           "KV and routing rows to the decode replicas through the Mooncake pool (needs kv_pool = 'mooncake'; "
           "rl_loop/disagg.py; with router = 'llmd' the picker's prefill/decode profiles choose both: "
           "moerl router-config --prefill-endpoints); 0: every replica does both", ge=0)
    decode_replicas: StrictInt = knob(
        0, "with prefill_replicas: managed replicas (d0, d1, ...) that load the pooled prompt and sample; "
           "inference.replicas becomes prefill_replicas + decode_replicas", ge=0)
    weight_sync_timeout_s: StrictFloat = knob(
        300.0, "sharded lanes: a replica whose update has not answered by then is taken out of rotation (a hung "
               "worker: vLLM's /health stays OK), and the trainer's senders drop its lanes", gt=0)
    weight_sync: Literal["auto", "shm", "net", "te", "fs"] = knob(
        "auto", "how new weights reach the replicas: 'shm' (every trainer rank streams its own slices through "
                "shared memory, same host), 'net' (the same over gloo/TCP), 'te' (the same pulled with Mooncake "
                "Transfer Engine: RDMA where the cluster has it), 'fs' (safetensors in the run dir); 'auto' is 'shm' for "
                "managed replicas, else 'fs' (rl_loop/weight_lane.py says why)")

    @model_validator(mode="after")
    def _tp_of_managed_replicas(self) -> InferenceConfig:
        if self.tensor_parallel != 1 and self.replicas == 0:
            raise ValueError(f"inference.tensor_parallel = {self.tensor_parallel} sizes managed replicas; with "
                             "inference.endpoints their own servers set it: leave it at 1")
        return self

    @model_validator(mode="after")
    def _prefill_decode(self) -> InferenceConfig:
        if not (self.prefill_replicas or self.decode_replicas):
            return self
        if not (self.prefill_replicas and self.decode_replicas):
            raise ValueError(f"inference.prefill_replicas = {self.prefill_replicas} and decode_replicas = "
                             f"{self.decode_replicas}: disaggregation needs at least one of each (or 0 and 0)")
        if self.kv_pool != "mooncake":
            raise ValueError("inference.prefill_replicas hand the prompt's KV to the decode replicas through the "
                             "Mooncake pool: set inference.kv_pool = 'mooncake'")
        self.replicas = self.prefill_replicas + self.decode_replicas
        return self

    @model_validator(mode="after")
    def _pool_has_replicas(self) -> InferenceConfig:
        if self.kv_pool != "off" and self.replicas == 0:
            raise ValueError(f"kv_pool = '{self.kv_pool}' pools the KV of managed replicas; set inference.replicas "
                             "to 1 or more, or kv_pool = 'off' with inference.endpoints")
        return self


@dataclass(config=CONFIG)
class RolloutConfig:
    task: StrictStr = knob(
        "charclass",
        "built-in task (charclass; charclass_turns: multi-turn), or verifiers:<environment id> (a verifiers "
        "environment, loaded with verifiers.load_environment; needs moerl[verifiers])",
        min_length=1,
    )
    task_args: dict[StrictStr, Any] = knob(
        dict,
        "keyword arguments of the task: the built-in's options (charclass, charclass_turns: preamble; "
        "charclass_turns: turns) or the verifiers "
        "environment's load_environment arguments; e.g. {turns = 2}",
    )
    chat_format: Literal["auto", "plain", "template"] = knob(
        "auto",
        "verifiers environments: how chat messages become tokens; 'plain' (role: text lines), 'template' (the "
        "tokenizer's chat template), 'auto' (template when the tokenizer has one)",
    )
    tool_parser: StrictStr = knob(
        "auto", "tool environments: vLLM's tool parser that turns sampled text into tool calls (a "
                "ToolParserManager name, e.g. kimi_k2, glm47); 'auto': the model family's (model.arch)", min_length=1)
    tool_sandbox: StrictBool = knob(
        True, "tool environments: run each rollout's tool calls in a sandbox process (rl_loop/tools/sandbox.py); "
              "false: in moerl's own process, as verifiers does")
    tool_wall_s: StrictFloat = knob(10.0, "sandbox: wall-clock limit of one tool call", gt=0)
    tool_cpu_s: StrictInt = knob(5, "sandbox: CPU-seconds limit of one tool call", ge=1)
    tool_output_bytes: StrictInt = knob(65536, "sandbox: most bytes a tool call may answer (and print)", ge=1)
    prompts_per_step: StrictInt = knob(8, "GRPO groups per step", ge=1)
    samples_per_prompt: StrictInt = knob(8, "completions per prompt (group size)", ge=1)
    max_tokens: StrictInt = knob(8, "completion length (per model turn in multi-turn tasks)", ge=1)
    temperature: StrictFloat = knob(1.0, "sampling temperature (0: greedy)", ge=0)
    max_off_policy_steps: StrictInt = knob(
        1,
        "how many policy versions a group may lag the trainer: rollouts for step n may be generated by "
        "policy n-1-k for k <= this; 0 is synchronous; older groups are dropped and counted",
        ge=0,
    )


@dataclass(config=CONFIG)
class TrainConfig:
    steps: StrictInt = knob(40, "optimizer steps", ge=1)
    lr: StrictFloat = knob(1e-3, "AdamW learning rate: the peak of the schedule, which decays linearly to a tenth "
                                 "of it over the run (titan_ext's lr_scheduler, no decay_ratio)", gt=0)
    lr_warmup_steps: StrictInt = knob(
        0, "steps over which the learning rate first rises linearly to `lr` (lr_scheduler.warmup_steps); the "
           "decay then spans the remaining steps", ge=0)
    replay: StrictBool = knob(True, "router replay: the trainer uses the experts inference chose")
    max_ratio: StrictFloat = knob(2.0, "tokens with p_train/p_infer outside [1/r, r] are masked from the loss", gt=1)
    normalize_std: StrictBool = knob(False, "divide group advantages by the group's reward std")
    checkpoint_interval: StrictInt = knob(5, "TorchTitan checkpoint every K steps (for --resume)", ge=1)
    nproc: StrictInt = knob(1, "trainer processes (torchrun --nproc_per_node)", ge=1)
    context_parallel: StrictInt = knob(
        1, "trainer processes that split every sequence between them (TorchTitan --parallelism."
           "context_parallel_degree), for sequences one process cannot hold; divides nproc; MLA models", ge=1)
    dispatcher: Literal["lean", "torchtitan", "deepep"] = knob(
        "lean", "MoE token dispatcher of the trainer (as torchtitan train --titan_ext.dispatcher)")
    fp8: StrictBool = knob(False, "expert GEMMs in fp8 (as torchtitan train --titan_ext.fp8; lean or deepep dispatcher)")
    loss_chunk_tokens: StrictInt = knob(
        0, "LM head and loss on chunks of about this many of a trainer process's positions, never holding "
           "[tokens, vocabulary] logits (rl_loop/chunked_loss.py; as torchtitan train --titan_ext.loss_chunks); "
           "0: whole sequences", ge=0)
    indexer_fp8: StrictBool = knob(
        True, "a DSA model's (GLM-5) indexer ranks keys from fp8 queries and keys as vLLM's indexer does, so "
              "the trainer attends to the keys the sampler attended to (torchtitan train --titan_ext.indexer_fp8); "
              "no effect on other models")
    replay_indexer: StrictBool = knob(
        False, "a DSA model's (GLM-5) attention reads the keys inference's indexer chose: the replicas capture them "
               "(MOERL_INDEXER_KEYS=1) and the routing record carries them (about 1.6 KB a token and layer at 131k "
               "and top-2048: docs/glm5.md); needs replay")
    optimizer_offload: StrictBool = knob(
        False, "AdamW's moments in host memory from each forward until the optimizer step (as torchtitan "
               "train --titan_ext.optimizer_offload)")
    activation_offload: StrictBool = knob(
        False, "each transformer block's input in host memory from its forward to its backward (as torchtitan "
               "train --titan_ext.activation_offload)")
    cpus: CpuList = knob(
        "auto",
        "CPU cores of the trainer, e.g. '0-1'; 'auto': the first half of the machine's cores when the "
        "replicas are auto too (trainer and inference on disjoint cores, so async steps overlap); '' "
        "(--set train.cpus=): no pinning",
    )

    @model_validator(mode="after")
    def _model_builds(self) -> TrainConfig:
        """Refuse what the trainer's model builder would refuse (titan_ext's own rule), before anything starts.

        Only fp8 experts constrain the dispatcher, and the rule's module imports TorchTitan (seconds),
        so configs without fp8 (the defaults `moerl rl --help` shows) never import it."""
        if self.nproc % self.context_parallel:
            raise ValueError(f"context_parallel = {self.context_parallel} does not divide nproc = {self.nproc}: the "
                             "trainer's processes are data parallel x context parallel; set nproc to a multiple")
        if self.replay_indexer and not self.replay:
            raise ValueError("replay_indexer = true needs replay = true (the indexer keys travel in the routing record)")
        if self.fp8:
            from titan_ext.models.builder import check_moe_options

            try:
                check_moe_options(self.dispatcher, self.fp8)
            except ValueError as e:
                raise ValueError(f"fp8 = true with dispatcher = {self.dispatcher!r}: {e}") from None
        return self


@dataclass(config=CONFIG)
class RLConfig:
    run_dir: StrictStr = knob("outputs/rl", "where logs, plots, batches, weights and checkpoints go", min_length=1)
    seed: StrictInt = knob(0, "seed for prompts, sampling and the tiny checkpoint", ge=0)
    model: ModelConfig = knob(ModelConfig, "")
    inference: InferenceConfig = knob(InferenceConfig, "")
    rollout: RolloutConfig = knob(RolloutConfig, "")
    train: TrainConfig = knob(TrainConfig, "")

    @model_validator(mode="after")
    def _context_parallel_model(self) -> RLConfig:
        """titan_ext's rule, checked when context parallel is asked for."""
        if self.train.context_parallel > 1:
            from titan_ext.models import check_context_parallel

            try:
                check_context_parallel(self.model.arch)
            except ValueError as e:
                raise ValueError(f"train.context_parallel = {self.train.context_parallel}: {e} (model.arch); "
                                 "set train.context_parallel = 1") from None
        return self

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RLConfig:
        """The config in `path` with `overrides` (dotted key -> value) applied on top; ConfigError if invalid."""
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: {e}") from None
        for dotted, value in (overrides or {}).items():
            *parents, leaf = dotted.split(".")
            node = data
            for p in parents:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{dotted}: {p} is not a table")
            node[leaf] = value
        try:
            return TypeAdapter(cls).validate_python(data)
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None


def _fields(cls) -> dict:
    """Field name -> pydantic FieldInfo (annotation, default, constraints, help)."""
    return cls.__pydantic_fields__


SECTIONS = {name: info.annotation for name, info in _fields(RLConfig).items()
            if dataclasses.is_dataclass(info.annotation)}


def _section_of(path: tuple[str, ...]):
    """The dataclass that holds key `path[-1]` (None when the path leads into a plain table such as task_args)."""
    cls = RLConfig
    for part in path[:-1]:
        info = _fields(cls).get(part)
        if info is None or not dataclasses.is_dataclass(info.annotation):
            return None
        cls = info.annotation
    return cls


def _one_line(e: ValidationError) -> str:
    msgs = []
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "top level"
        if err["type"] == "unexpected_keyword_argument":
            section = _section_of(loc)
            known = ", ".join(_fields(section)) if section else ""
            msgs.append(f"{key}: unknown key (known: {known})")
        elif err["type"] == "value_error":
            msgs.append(f"{key}: {err['ctx']['error']}" if loc else str(err["ctx"]["error"]))
        elif err["type"] in ("dict_type", "dataclass_type"):  # the user wrote TOML: say it in TOML's words
            msgs.append(f"{key}: must be a table, got {err['input']!r}")
        else:
            msgs.append(f"{key}: {err['msg']}, got {err['input']!r}")
    return "; ".join(msgs)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> {dotted key: value} (see the module docstring for how values are read)."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=10")
        section = _section_of(tuple(key.split(".")))
        info = _fields(section).get(key.rsplit(".", 1)[-1]) if section else None
        out[key] = raw if info is not None and info.annotation is str else _toml_value(raw)
    return out


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _describe_type(info) -> str:
    if get_origin(info.annotation) is Literal:
        kind = " | ".join(repr(a) for a in get_args(info.annotation))
    else:
        kind = {list: "list", dict: "table"}.get(get_origin(info.annotation)) or info.annotation.__name__
    bounds = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length"}
    for m in info.metadata:
        for attr, sym in bounds.items():
            if getattr(m, attr, None) is not None:
                kind += f", {sym} {getattr(m, attr)}"
    return kind


def describe() -> str:
    """Every knob with its default, type and help, for `moerl rl --help`."""
    lines = []

    def knobs(cls, indent: str) -> None:
        for name, info in _fields(cls).items():
            if name in SECTIONS and cls is RLConfig:
                continue
            default = info.get_default(call_default_factory=True)
            lines.append(f"{indent}{name} = {default!r}  # {info.description} [{_describe_type(info)}]")

    knobs(RLConfig, "  ")
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        knobs(cls, "  ")
    return "\n".join(lines)
