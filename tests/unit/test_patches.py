"""Every fix in patches/ must still be needed; each test here fails once upstream fixes the gap.

The contract all patches share (probes, version ranges, loud failures, no upstream write outside
a registered module) is tests/unit/test_upstream_hooks.py's.
"""

import importlib
import time
from types import SimpleNamespace

import pytest
import torch

import patches
import titan_ext
from patches.fsdp_gloo_sum_reduction import gloo_premul_sum_error
from tests.conftest import ulp_tol

FIXES = [m for m in patches.PATCH_MODULES if m.startswith("patches.")]


def test_every_fix_here_is_registered_and_documented():
    assert len(FIXES) == 11
    for m in FIXES:
        (p,) = importlib.import_module(m).PATCHES
        assert p.upstream and p.symptom and m == f"patches.{p.name}"


def test_torch_still_lacks_distributed_set_timeout():
    import torch.distributed as dist

    titan_ext.activate()
    importlib.reload(importlib.import_module("patches.torch_distributed_set_timeout"))
    # The shim is ours, not torch's: torch 2.13 never defined it.
    assert dist.set_timeout.__module__ == "patches.torch_distributed_set_timeout"


def test_torchtitan_still_defaults_to_cuda_without_accelerator(monkeypatch):
    assert not torch.accelerator.is_available()
    import torchtitan.tools.utils as tt_utils

    assert tt_utils._get_available_device_type() is None  # what makes torchtitan fall back to "cuda"
    titan_ext.activate()

    assert tt_utils.device_type == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun sets it; get_local_device refuses to guess without it
    assert tt_utils.get_local_device().type == "cpu"


def test_gloo_still_rejects_premul_sum():
    assert "PREMUL_SUM" in gloo_premul_sum_error()


def test_activation_is_idempotent():
    titan_ext.activate()
    assert titan_ext.activate() == []


def test_torchtitan_still_imports_data_parallel_mesh_dims_from_torch_fsdp():
    """torchtitan 0.3.0 imports the name at module level; torch 2.11 (the H200 machines) lacks it.

    Here (torch 2.13) torch has it, so the patch must stay inactive; it is needed exactly
    where torch lacks the name. Delete the patch once no supported torch lacks it or
    torchtitan stops importing it.
    """
    import importlib.util
    import pathlib

    import torch.distributed.fsdp as fsdp

    from patches import torch_fsdp_data_parallel_mesh_dims as patch_mod

    root = pathlib.Path(importlib.util.find_spec("torchtitan").origin).parent
    importers = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "from torch.distributed.fsdp import DataParallelMeshDims" in p.read_text()
    ]
    assert "models/deepseek_v3/mtp.py" in importers, importers
    assert titan_ext.trainer_patches()[0] is patch_mod.PATCH  # activated before anything imports torchtitan
    assert patch_mod.PATCH.needed() == (not hasattr(fsdp, "DataParallelMeshDims"))
    if patch_mod.PATCH.needed() is False:
        assert fsdp.DataParallelMeshDims is not patch_mod.DataParallelMeshDims  # torch's own, untouched


def test_data_parallel_mesh_dims_stand_in_applies_where_torch_lacks_it(monkeypatch):
    import torch.distributed.fsdp as fsdp

    from patches import torch_fsdp_data_parallel_mesh_dims as patch_mod

    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert patch_mod.PATCH.needed()
    patch_mod.PATCH.apply()
    assert not patch_mod.PATCH.needed()
    dims = fsdp.DataParallelMeshDims(shard=("dp_shard", "cp"))
    assert dims.shard_names == ("dp_shard", "cp") and dims.replicate_names == ()
    with pytest.raises(ValueError):
        fsdp.DataParallelMeshDims()


def test_vllm_cpu_rope_kernel_still_misrotates_mla_layout():
    """vllm-cpu 0.32's CPU `rotary_embedding` kernel on the layout MLA passes (strided 3-D q slice,
    strided k_pe view) against vLLM's own torch rope: wrong by O(1) from position 1 on.
    Fails once the kernel is fixed; then delete patches/vllm_cpu_mla_rope.py."""
    from patches import vllm_cpu_mla_rope as patch_mod

    err = patch_mod.mla_probe_error()  # calls the raw kernel, whatever forward_cpu is now
    assert err > patch_mod.PROBE_TOLERANCE, (
        f"the CPU rope kernel now rotates strided MLA q/k correctly (max err {err:.2f} x eps x |ref|): drop the patch")
    import vllm  # noqa: F401

    patch_mod.PATCH.apply()
    assert not patch_mod.PATCH.needed()


@pytest.mark.parametrize("tokens", [1, 9])  # 1: a decode step, where the strided views are trivially contiguous
@pytest.mark.parametrize("neox", [False, True])
def test_vllm_cpu_mla_rope_patch_rotates_like_reference(neox, tokens):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from patches import vllm_cpu_mla_rope as patch_mod

    patch_mod.PATCH.apply()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, is_neox_style=neox,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    heads, nope, kv_lora = 3, 32, 512
    q = torch.randn(tokens, heads, nope + 64, generator=gen).to(torch.bfloat16)
    kv = torch.randn(tokens, kv_lora + 64, generator=gen).to(torch.bfloat16)
    positions = torch.arange(100, 100 + tokens)
    q_ref, k_ref = rope.forward_native(positions, q[..., nope:].clone(), kv[:, kv_lora:].unsqueeze(1).clone())

    # As vLLM's MLA calls it (mla.py): strided q slice and k_pe view, results used.
    q_mla, kv_mla = q.clone(), kv.clone()
    k_pe = kv_mla[:, kv_lora:].unsqueeze(1)
    q_mla[..., nope:], k_out = rope.forward_cpu(positions, q_mla[..., nope:], k_pe)
    # The torch path rounds both products and their difference to bf16, the kernel at least its result:
    # up to 2 ulps apart at the reference's magnitude (measured), 3 leaves room for a kernel rounding more often.
    q_tol, k_tol = (dict(atol=ulp_tol(torch.bfloat16, ref, 3), rtol=0) for ref in (q_ref, k_ref))
    torch.testing.assert_close(q_mla[..., nope:].float(), q_ref.float(), **q_tol)
    torch.testing.assert_close(k_out.float(), k_ref.float(), **k_tol)
    torch.testing.assert_close(q_mla[..., :nope], q[..., :nope], atol=0, rtol=0)  # nope part untouched
    # In place, as callers relying on the kernel's in-place contract (the DSA indexer) expect.
    torch.testing.assert_close(kv_mla[:, kv_lora:].float(), k_ref.float().squeeze(1), **k_tol)
    torch.testing.assert_close(kv_mla[:, :kv_lora], kv[:, :kv_lora], atol=0, rtol=0)

    # 2-D [tokens, heads * head_size] (standard attention) still goes straight to the kernel, and is right.
    q2, k2 = q[..., nope:].reshape(tokens, -1).clone(), kv[:, kv_lora:].clone()
    rope.forward_cpu(positions, q2, k2)
    torch.testing.assert_close(q2.view(tokens, heads, 64).float(), q_ref.float(), **q_tol)
    torch.testing.assert_close(k2.float(), k_ref.float().squeeze(1), **k_tol)


def test_vllm_cpu_moe_reload_still_skips_prepack():
    """vllm-cpu 0.32 runs the experts' process_weights_after_loading only on the first load.

    The behaviour (expert tensors differ from a fresh load after a reload) is
    checked end to end by tests/integration/test_weight_sync.py; here the
    upstream structure that causes it."""
    from patches import vllm_cpu_moe_reload_prepack as p

    src = p.upstream_source()
    assert src is not None, "vLLM not installed or _setup_kernel moved"
    assert p.upstream_skips_hook_on_reload(src)
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method  # noqa: F401

    if not getattr(vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel,
                   "_moerl_cpu_prepack_on_reload", False):
        assert p.PATCH.needed()
    p.PATCH.apply()
    assert not p.PATCH.needed()


def test_torchtitan_ep_dispatcher_still_asks_is_non_strict_tracing(monkeypatch):
    """torchtitan 0.3.0's all-to-all dispatcher calls the name torch 2.11 lacks; the
    stand-in (applied only where torch lacks it) answers what torch answers outside
    non-strict tracing."""
    import inspect

    import torch.compiler
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from patches import torch_compiler_is_non_strict_tracing as patch_mod

    assert "_is_non_strict_tracing" in inspect.getsource(AllToAllTokenDispatcher)
    assert patch_mod.PATCH.needed() == (not hasattr(torch.compiler, "_is_non_strict_tracing"))
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        assert torch.compiler._is_non_strict_tracing() is False  # what the stand-in answers
        monkeypatch.delattr(torch.compiler, "_is_non_strict_tracing")
    assert patch_mod.PATCH.needed()
    patch_mod.PATCH.apply()
    assert not patch_mod.PATCH.needed() and torch.compiler._is_non_strict_tracing() is False


def test_torch_meta_grouped_mm_still_rejects_fp32(monkeypatch):
    """The stock meta kernel refuses fp32 (what breaks compiling an fp32 MoE block); the
    patched one gives the CPU kernel's output shape, strides and dtype."""
    import torch._meta_registrations as meta

    from patches import torch_grouped_mm_meta_dtype as patch_mod

    titan_ext.activate()

    assert patch_mod.fp32_meta_error() is None  # applied
    a, b, offs = torch.randn(8, 8), torch.randn(2, 8, 4), torch.tensor([3, 8], dtype=torch.int32)
    for args in ((a, b), (a.t(), torch.randn(8, 4))):  # forward and the weight-gradient layout
        ref = torch._grouped_mm(*args, offs=offs)
        out = torch._grouped_mm(*(t.to("meta") for t in args), offs=offs.to("meta"))
        assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype)
    monkeypatch.setattr(meta, "_meta_grouped_mm_common", patch_mod._STOCK)
    assert "BF16" in patch_mod.fp32_meta_error()


def test_vllm_executor_still_leaves_answers_unread_after_a_worker_error():
    """vLLM 0.32's collective_rpc raises at worker 0's error answer with worker 1's answer to
    the same call still queued; the next call then reads it as its own. Fails once upstream
    reads every answer; then delete patches/vllm_executor_reads_every_answer.py."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

    from patches import vllm_executor_reads_every_answer as p

    upstream = getattr(MultiprocExecutor.collective_rpc, "__wrapped__", MultiprocExecutor.collective_rpc)
    assert p.leaves_answers_unread(upstream)
    ok, failed = WorkerProc.ResponseStatus.SUCCESS, WorkerProc.ResponseStatus.FAILURE
    ex = p.fake_executor([[(failed, "refused"), (ok, "paused")], [(failed, "refused"), (ok, "paused")]])
    with pytest.raises(RuntimeError, match="refused"):
        upstream(ex, "update_weights")
    with pytest.raises(RuntimeError, match="refused"):  # the stale answer of worker 1
        upstream(ex, "pause")


def test_patched_executor_reads_every_answer_before_raising():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

    from patches import vllm_executor_reads_every_answer as p

    p.PATCH.apply()
    assert not p.PATCH.needed() and not p.leaves_answers_unread()
    rpc = MultiprocExecutor.collective_rpc
    ok, failed = WorkerProc.ResponseStatus.SUCCESS, WorkerProc.ResponseStatus.FAILURE
    ex = p.fake_executor([[(failed, "checksum mismatch"), (ok, "p0"), (ok, "a0")],
                          [(failed, "another worker refused"), (ok, "p1"), (failed, "bad box")]])
    with pytest.raises(RuntimeError, match="'checksum mismatch; another worker refused'"):
        rpc(ex, "update_weights")
    assert rpc(ex, "pause") == ["p0", "p1"]
    with pytest.raises(RuntimeError, match="'bad box'"):  # only worker 1 failed
        rpc(ex, "update_weights")
    assert all(not mq.answers for mq in ex.response_mqs)
    ex = p.fake_executor([[(ok, "a0"), (ok, "b0")], [(ok, "a1")]])
    assert rpc(ex, "one", unique_reply_rank=1) == "a1"  # only that worker answers
    assert rpc(ex, "one", unique_reply_rank=0) == "a0"
    ex.response_mqs[1].answers.append((failed, "late"))
    future = rpc(ex, "both", non_block=True)
    with pytest.raises(RuntimeError, match="'late'"):
        future.result()
    assert all(not mq.answers for mq in ex.response_mqs)


def test_vllm_still_picks_cpu_kernels_by_asking_torch_for_amx():
    """`vllm_cpu_portable_kernels` works by answering one question: vLLM's CPU kernel selection must still
    ask `torch.cpu._is_amx_tile_supported()` (attention backend, MoE experts, paged attention ISA)."""
    import inspect

    import vllm.platforms.cpu as cpu_platform
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.v1.attention.backends import cpu_attn

    from patches import vllm_cpu_portable_kernels as p

    for module in (cpu_platform, cpu_moe, cpu_attn):
        assert "torch.cpu._is_amx_tile_supported()" in inspect.getsource(module), module.__name__
    assert p.PATCH.probe() is None
    assert p._no_amx() is False


def test_vllm_shm_readers_still_spin_a_second_after_each_read():
    """`vllm_cpu_shm_reader_naps` shortens upstream's busy window: it is needed while a reader still yields
    in a loop for `busy_loop_s` (1 s by default) after its last read."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from patches import vllm_cpu_shm_reader_naps as p

    assert inspect.signature(SpinCondition.__init__).parameters["busy_loop_s"].default == 1
    assert "sched_yield()" in inspect.getsource(SpinCondition.wait)
    assert p.PATCH.probe() is None


def test_a_napping_reader_spins_first_then_sleeps_then_waits_as_upstream(monkeypatch):
    from patches import vllm_cpu_shm_reader_naps as p

    calls = []
    wait = p.napping(lambda self, timeout_ms=None: calls.append(timeout_ms))
    reader = SimpleNamespace(busy_loop_s=1.0, last_read=time.monotonic())
    wait(reader, 5)  # just read: upstream's yield loop
    assert calls == [5]
    reader.last_read = time.monotonic() - 10 * p.SPIN_S
    t0 = time.perf_counter()
    wait(reader, 5)  # inside the busy window, past the spin: a nap instead of upstream's yield
    assert calls == [5] and time.perf_counter() - t0 >= p.NAP_S
    reader.last_read = time.monotonic() - 2.0
    wait(reader, 7)  # past the busy window: upstream's socket wait
    assert calls == [5, 7]

    monkeypatch.delenv(p.ENV, raising=False)
    assert not p.PATCH.needed()
    monkeypatch.setenv(p.ENV, "1")
    assert p.PATCH.needed()

