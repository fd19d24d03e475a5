"""Every patch must still be needed; each test here fails once upstream fixes the gap."""

import importlib

import pytest
import torch

import patches
from patches.fsdp_gloo_sum_reduction import gloo_premul_sum_error


def test_patch_registry_is_complete_and_documented():
    names = [p.name for p in patches.all_patches()]
    assert len(names) == len(set(names)) == len(patches.PATCH_MODULES)
    for p in patches.all_patches():
        assert p.upstream and p.symptom


def test_torch_still_lacks_distributed_set_timeout():
    import torch.distributed as dist

    import titan_ext  # noqa: F401 applies the patch

    importlib.reload(importlib.import_module("patches.torch_distributed_set_timeout"))
    # The shim is ours, not torch's: torch 2.13 never defined it.
    assert dist.set_timeout.__module__ == "patches.torch_distributed_set_timeout"


def test_torchtitan_still_defaults_to_cuda_without_accelerator():
    assert not torch.accelerator.is_available()
    import torchtitan.tools.utils as tt_utils

    assert tt_utils._get_available_device_type() is None  # what makes torchtitan fall back to "cuda"
    import titan_ext  # noqa: F401

    assert tt_utils.device_type == "cpu"
    assert tt_utils.get_local_device().type == "cpu" if "LOCAL_RANK" in __import__("os").environ else True


def test_gloo_still_rejects_premul_sum():
    assert "PREMUL_SUM" in gloo_premul_sum_error()


def test_apply_all_is_idempotent():
    import titan_ext  # noqa: F401

    assert patches.apply_all() == []


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
    assert patches.PATCH_MODULES[0] == "patches.torch_fsdp_data_parallel_mesh_dims"  # before torchtitan imports
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
