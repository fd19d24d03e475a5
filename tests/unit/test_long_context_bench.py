"""benchmarks.long_context: the flags each technique passes to `torchtitan train`, and how a run is read."""

from benchmarks.long_context import TECHNIQUES, flags, outcome


def test_each_technique_adds_its_flags_with_the_ac_subcommand_last():
    assert flags(TECHNIQUES["none"][0], 24576) == ()
    assert flags(TECHNIQUES["loss_chunks"][0], 65536) == ("--titan_ext.loss_chunks", "8")
    assert flags(TECHNIQUES["loss_chunks+offload+full_ac"][0], 131072) == (
        "--titan_ext.loss_chunks", "16", "--titan_ext.optimizer_offload", "--titan_ext.activation_offload",
        "activation-checkpoint:full")
    assert len({ladder[0] for _, ladder in TECHNIQUES.values()}) == 1, "one common length for the cost ratios"


def test_a_run_is_trained_out_of_memory_or_failed_with_its_last_line():
    assert outcome({"returncode": 0, "tps_median": 100.0}) == "trained"
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert outcome({"returncode": 1, "tps_median": None, "log_tail": oom}) == "out of memory"
    assert outcome({"returncode": 1, "tps_median": None, "log_tail": "x\nValueError: bad\n"}) == "failed: ValueError: bad"
    assert outcome({"returncode": -9, "tps_median": None, "log_tail": ""}) == "failed: no log"
