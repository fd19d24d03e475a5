"""Shared fixtures: tiny HF checkpoints made once per session (no downloads)."""

from __future__ import annotations

import ast
import asyncio
import gc
import io
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from patches.vllm_cpu_shm_reader_naps import ENV as SHM_NAP_ENV
from vllm_ext.api import moe_layer_indices
from vllm_ext.routing.record import decode_record_b64

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _spread_vllm_threads() -> None:
    """Under xdist, vLLM servers compute on one thread that the kernel moves to a free core, and nothing spins.

    Left alone, vllm-cpu binds every server's compute threads to core 0 (reserving the last core),
    so under xdist every worker's servers queue on one core while the other idles; a core per
    worker still leaves one idle while the servers of two workers queue on the other. A test that
    places its replicas itself (`rl_loop.placement`, `moerl rl`'s `inference.cpus`) sets the
    variable for them and is unaffected. Pinned or not, every server shares its cores with the
    other workers' tests, so its queue readers nap (`patches.vllm_cpu_shm_reader_naps`; `moerl rl`
    leaves pinned replicas spinning unless the environment asks)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and len(os.sched_getaffinity(0)) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # The workers share the cores: torch in a worker (and in what it starts, unless the test sets
        # threads itself) computes on one thread, and an OpenMP thread with nothing to do sleeps instead
        # of spinning on the core the other worker computes on. Spinning threads made a torch training
        # loop beside the other worker's server 3.5x slower (test_rl_tools' warm start: 157 s, 73 s).
        for name, value in (("OMP_NUM_THREADS", "1"), ("OMP_WAIT_POLICY", "PASSIVE"), ("KMP_BLOCKTIME", "0"),
                            (SHM_NAP_ENV, "1")):
            os.environ.setdefault(name, value)


_spread_vllm_threads()

# `moerl rl` gives its trainer and its replicas disjoint halves of the cores (`rl_loop.placement`),
# right for a run that has the machine to itself. Beside the other xdist workers' tests every run
# would put its replicas on the same second core, leaving the first idle while they generate (three
# runs at once kept one of the two cores busy for minutes): tests start it unpinned.
UNPINNED = ("--set", "train.cpus=", "--set", "inference.cpus=")


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` with the garbage collector held off while it builds the tree.

    CPython 3.11 before the fix of gh-106905 (Debian's 3.11.2 here) checks a recursion depth that a
    finalizer run by a collection during the tree's construction (or a thread it lets run) can move:
    `SystemError: AST constructor recursion depth mismatch`, seen twice in 6 CI runs on source that
    parses. Without a collection no Python code runs inside the construction."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if enabled:
            gc.enable()


def ulp(dtype, magnitude):
    """The spacing of `dtype` (a torch floating dtype) at `magnitude`: one unit in the last place.
    `magnitude` is a number, or a tensor for the spacing at each of its elements (a float32 tensor).

    Tolerances on bf16/fp16 data are written as a count of these, at the magnitude of the values
    compared, because a kernel may round differently on another processor; a fixed `atol` tuned on
    one machine is one ulp too tight on the next. Below the smallest normal the spacing stays that
    of the subnormals."""
    import math

    import torch

    info = torch.finfo(dtype)
    if isinstance(magnitude, torch.Tensor):
        _, exponent = torch.frexp(magnitude.detach().float().abs().clamp_min(info.tiny))
        return info.eps * torch.exp2(exponent.float() - 1)
    magnitude = max(abs(float(magnitude)), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def ulp_tol(dtype, reference, ulps: float) -> float:
    """Absolute tolerance of `ulps` units of `dtype` at the largest magnitude in `reference` (a tensor)."""
    return ulps * ulp(dtype, reference.detach().abs().max().item())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch, init_scale=0.02, dtype="float32") -> Path, cached per argument set."""
    from rl_loop.tiny_models import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("tiny")

    def make(arch: str, init_scale: float = 0.02, dtype: str = "float32") -> Path:
        return make_tiny_checkpoint(arch, base / f"{arch}-{dtype}-{init_scale}", dtype=dtype, init_scale=init_scale)

    return make


def run_moerl(*args: str) -> subprocess.CompletedProcess:
    """`moerl ARGS...` run in this process: `rl_loop.cli.main`, the console script's function, with its
    output and exit code captured as the CompletedProcess a subprocess would give.

    For the commands that compute in one process (check-parity, info, make-tiny-checkpoint, plan): a
    `moerl` process spends 4-5 CPU-s importing torch, TorchTitan and transformers before it parses its
    arguments, which the test worker has imported already. The README's and docs/' commands still run
    as processes (tests/unit/test_docs_commands.py), each command's --help too (test_cli_help.py).
    An uncaught exception is what the interpreter would make of it: its traceback on stderr, code 1.
    Unlike a process: no timeout, and log handlers bound to the real stderr before the call write there."""
    from rl_loop.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:  # what the interpreter makes of the code main exits with
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - a crash is a result here, as a process's exit code 1 is
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["moerl", *args], code, out.getvalue(), err.getvalue())


def run_torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc args...` and return the completed process (output captured).
    On timeout the whole job is killed, workers too: torchrun starts each in a session of its own, so
    killing torchrun (or its process group) alone leaves them running."""
    # --standalone: a free rendezvous port, so concurrent runs (two test sessions, a moerl run) never collide on 29500
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            import psutil

            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wire_tensors(tensors: dict, max_elems: int | None = None) -> dict:
    """HF-named tensors in the sharded transport's wire layout (``plan.expert_groups``: experts stacked)."""
    import torch

    from vllm_ext.transport.plan import EXPERT_GROUP_ELEMS, expert_groups

    groups = expert_groups({n: tuple(t.shape) for n, t in tensors.items()}, max_elems or EXPERT_GROUP_ELEMS)
    return {g: tensors[g] if ms == [g] else torch.stack([tensors[m] for m in ms]) for g, ms in groups.items()}


def corrupt_first_ring_piece(publish: Callable) -> Callable:
    """A `shm.RingWriter._publish` that flips a byte of a ring's first piece after its sender
    hashed it (what a bad copy or link does), then publishes it with `publish`."""

    def corrupting(self, n, digest):
        if self.seq == 0:
            self.ring.view[self.ring.slot_offset(0) + n // 2] ^= 0x01
        publish(self, n, digest)

    return corrupting


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: the modules marked `slow` (servers, `moerl` runs: one to four minutes each),
    then the other integration modules (torchrun numerics), then the unit tests, each group in file
    order. `make test` hands whole files to its three xdist workers in this order (`--dist loadfile
    --no-loadscope-reorder`), so the quick files fill in at the end and the workers finish at
    about the same time."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, "tests/integration/" not in item.nodeid))


@contextmanager
def two_at_a_time(jobs: dict[Hashable, Callable[[], object]]) -> Iterator[dict[Hashable, Future]]:
    """Run every job (a no-argument callable, typically a command) in the background, two at a
    time, as futures by key. Commands that start servers or torchrun spend much of their time in
    single-threaded start-up (imports, config, model build), which leaves one of this 2-core
    machine's cores idle; the other job uses it. Jobs must not share ports or output paths."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {key: pool.submit(fn) for key, fn in jobs.items()}


def losses_from_log(text: str) -> list[float]:
    """Per-step losses from TorchTitan's log (rank 0 lines only when tagged)."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", text)
    seen: dict[int, float] = {}
    for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)", clean):
        seen.setdefault(int(m.group(1)), float(m.group(2)))
    return [seen[k] for k in sorted(seen)]


def mask_spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 loss mask: a multi-turn completion's model and environment turns."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def reference_record(base_url: str, model: str, ids: list[int], salt: str) -> np.ndarray:
    """Routing of one request over the whole sequence `ids`, isolated from any cached blocks by
    `salt`: what a stitched multi-turn record must equal (its rows for every fed token)."""

    async def one():
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                data = await resp.json()
        rec = decode_record_b64(data["choices"][0]["routed_experts"])
        assert rec.start == 0 and rec.num_rows == len(ids)
        return rec.expert_ids[: len(ids) - 1]

    return asyncio.run(one())


class HFReference:
    """Top-k expert ids from transformers' own routers, per MoE layer."""

    def __init__(self, path: Path, dtype: str):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        self.config = AutoConfig.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.layers = moe_layer_indices(self.config)
        self.gates = [self.model.model.layers[i].mlp.gate for i in self.layers]

    def routing(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T, L, K] sorted, scores [T, L, E] used for the choice, fp32)."""
        torch = self.torch
        got_ids, got_scores = {}, {}
        hooks = []
        for j, g in enumerate(self.gates):
            def hook(mod, inp, out, j=j):
                logits = out[0].float()
                if hasattr(mod, "e_score_correction_bias"):  # DeepSeek-V3 / Kimi: sigmoid + bias
                    scores = logits.sigmoid() + mod.e_score_correction_bias.float()
                else:  # Qwen3-MoE: softmax (monotone in logits)
                    scores = logits.softmax(-1)
                got_scores[j] = scores.numpy()
                got_ids[j] = out[2].numpy()
            hooks.append(g.register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model(torch.tensor([tokens[:-1]]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        ids = np.sort(np.stack([got_ids[j] for j in range(len(self.gates))], axis=1), axis=-1)
        scores = np.stack([got_scores[j] for j in range(len(self.gates))], axis=1)
        return ids, scores


@contextmanager
def transformers_dsa_indexer_as_vllm(model) -> Iterator[list]:
    """The indexers of a transformers GLM-5 `model` ranking keys as vLLM does (fp8 keys and queries,
    `vllm_ext.dsa.ops`) instead of in the model's dtype: the reference that isolates everything but
    the indexer's numerics. Single-sequence forwards without a cache, as the tests run them. Yields
    the list every indexer call appends its choice to (`[seq, topk]` key positions, -1 empty)."""
    import types

    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    from vllm_ext.dsa import ops

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                past_key_values=None):
        assert hidden_states.shape[0] == 1 and past_key_values is None, "batch 1, use_cache=False"
        seq = hidden_states.shape[1]
        rope, rest = self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(1, seq, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        (q_rot, q_pass), (k_rot, k_pass) = q.split([rope, rest], -1), k.split([rope, rest], -1)
        q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q_pass], -1)[0], torch.cat([k_rot, k_pass], -1)[0, :, 0]
        k_fp8, k_scale = ops.quantize_index_keys(k)
        picked = ops.rank_keys(q, self.weights_proj(hidden_states)[0], k_fp8, k_scale, torch.arange(seq),
                               self.index_topk, self.softmax_scale)
        picks.append(picked)
        # transformers scatters the indices into a mask; an empty slot (-1) repeats key 0, always selected
        return picked.clamp_min(0)[None]

    indexers = [m for m in model.modules() if isinstance(m, hf.GlmMoeDsaIndexer)]
    assert indexers, "not a GLM-5 (glm_moe_dsa) model"
    picks: list = []
    for m in indexers:
        m.forward = types.MethodType(forward, m)
    try:
        yield picks
    finally:
        for m in indexers:
            del m.forward
