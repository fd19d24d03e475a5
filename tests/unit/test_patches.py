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
