"""Expert parallel on gloo, per titan_ext dispatcher: EP=2 against EP=1 (logits and every parameter
gradient, fp32), with and without router replay; fp8 experts under EP; `torchtitan train` with
the titan_ext flags; the DeepEP path where its wheel and 2 GPUs exist.

Each EP=2 rank holds one of the batch's two sequences, so a row sent back to the wrong rank
or the wrong token changes the logits of the other sequence.
"""

import importlib.util

import pytest
import torch

from tests.conftest import ROOT, VENV_BIN, losses_from_log, run_torchrun, ulp_tol

WORKER = str(ROOT / "tests/integration/ep_logits_worker.py")
TOL = 1e-5  # fp32: the EP=2 forward and backward add the same terms as EP=1, in another order at most


# The worker's flag sets the tests below compare; each EP degree computes all of them in one torchrun run.
VARIANTS = [*(f"--titan_ext.dispatcher {d}{r}" for d in ("lean", "torchtitan") for r in ("", " --replay")),
            "--titan_ext.fp8 --replay"]


@pytest.fixture(scope="module")
def run_worker(tiny_checkpoint, tmp_path_factory):
    """run_worker(ep, *flags) -> {"logits", "grads"} of the fixed batch for one of VARIANTS. The first
    call for an EP degree runs the worker once for every variant; later calls read its results."""
    ckpt = tiny_checkpoint("kimi_k2", 0.1)
    out_dir = tmp_path_factory.mktemp("ep")
    cache: dict[int, dict[str, dict]] = {}

    def run(ep: int, *flags: str) -> dict:
        if ep not in cache:
            out = out_dir / f"ep{ep}.pt"
            proc = run_torchrun(ep, WORKER, str(ckpt), "kimi_k2", str(ep), str(out), *(f"--grads {v}" for v in VARIANTS))
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[ep] = dict(zip(VARIANTS, torch.load(out), strict=True))
        variant = " ".join(flags)
        assert variant in cache[ep], f"{variant!r} is not in VARIANTS"
        return cache[ep][variant]

    return run


def _assert_same(ep1: dict, ep2: dict, tol: float, skip: str = "") -> None:
    """Logits and every gradient (but those whose name contains `skip`, when given) within tol."""
    assert ep1["logits"].shape == ep2["logits"].shape and ep1["logits"].abs().max() > 0.1
    assert (ep1["logits"] - ep2["logits"]).abs().max().item() <= tol
    assert ep1["grads"].keys() == ep2["grads"].keys()
    routed = [n for n in ep1["grads"] if "routed_experts" in n]
    assert routed and all(ep1["grads"][n].abs().max() > 0 for n in routed)
    compared = [n for n in ep1["grads"] if not (skip and skip in n)]
    worst = max((ep1["grads"][n] - ep2["grads"][n]).abs().max().item() for n in compared)
    assert worst <= tol, worst


@pytest.mark.parametrize("replay", [False, True], ids=["own_routing", "replay"])
@pytest.mark.parametrize("dispatcher", ["lean", "torchtitan"])
def test_ep2_gives_the_logits_and_gradients_of_ep1(run_worker, dispatcher, replay):
    flags = ("--titan_ext.dispatcher", dispatcher, *(("--replay",) if replay else ()))
    reference = run_worker(1, *flags)
    _assert_same(reference, run_worker(2, *flags), TOL)
    if replay:  # the record really changed the routing
        own = run_worker(1, "--titan_ext.dispatcher", dispatcher)
        assert (own["logits"] - reference["logits"]).abs().max().item() > 1e-2


def test_lean_and_torchtitan_dispatchers_agree_at_ep1(run_worker):
    _assert_same(run_worker(1, "--titan_ext.dispatcher", "torchtitan"), run_worker(1, "--titan_ext.dispatcher", "lean"),
                 TOL)


def test_fp8_experts_under_ep2_compute_what_they_compute_at_ep1(run_worker):
    """At EP=2 each expert's rows arrive in the EP=1 order (rank r holds sequence r) with their
    scores, so the routed experts' fp8 quantisation sees the same rows and groups: the same
    numbers, to fp32 summation order. The shared expert is data parallel: each rank quantises
    its weight gradient's columns over its own tokens, so those two gradients agree to fp8
    resolution only (relative L2 within e4m3's half ulp, 2^-4)."""
    flags = ("--titan_ext.fp8", "--replay")
    fp8_ep1, fp8_ep2 = run_worker(1, *flags), run_worker(2, *flags)
    _assert_same(fp8_ep1, fp8_ep2, TOL, skip="shared_experts")
    shared = [n for n in fp8_ep1["grads"] if "shared_experts" in n]
    assert shared
    for n in shared:
        a, b = fp8_ep1["grads"][n], fp8_ep2["grads"][n]
        assert ((a - b).norm() / a.norm()).item() <= torch.finfo(torch.float8_e4m3fn).eps / 2, n
    exact = run_worker(1, "--titan_ext.dispatcher", "lean", "--replay")
    assert (fp8_ep1["logits"] - exact["logits"]).abs().max().item() > 1e-4, "fp8 really ran"


def test_torchtitan_train_with_fp8_and_expert_parallel_2_reduces_loss(tmp_path):
    proc = run_torchrun(
        2, str(VENV_BIN / "torchtitan"), "train", "--extension", "titan_ext", "--model", "kimi_k2", "--flavor", "tiny",
        "--dump_folder", str(tmp_path), "--training.steps", "12", "--parallelism.expert_parallel_degree", "2",
        "--titan_ext.dispatcher", "lean", "--titan_ext.fp8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = losses_from_log(proc.stdout + proc.stderr)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


def test_fp8_with_the_torchtitan_dispatcher_is_refused_in_one_line(tmp_path):
    proc = run_torchrun(
        1, str(VENV_BIN / "torchtitan"), "train", "--extension", "titan_ext", "--model", "kimi_k2", "--flavor", "tiny",
        "--dump_folder", str(tmp_path), "--training.steps", "1",
        "--titan_ext.dispatcher", "torchtitan", "--titan_ext.fp8",
    )
    assert proc.returncode != 0
    assert "fp8 experts need the lean or deepep dispatcher, not torchtitan's" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None or torch.cuda.device_count() < 2,
                    reason="not run: needs DeepEP v1 (deep_ep) and 2 GPUs")
def test_deepep_dispatcher_matches_lean_at_ep2(tmp_path):
    proc = run_torchrun(2, str(ROOT / "tests/integration/ep_dispatch_worker.py"), str(tmp_path / "deepep.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "deepep.pt")
    for name, (lean, deepep) in result.items():  # bf16: DeepEP rounds each rank's partial sum once more
        assert (lean - deepep).abs().max().item() <= ulp_tol(torch.bfloat16, lean, 4), name
