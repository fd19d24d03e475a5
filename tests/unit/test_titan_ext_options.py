"""`--titan_ext.*` flags: parsed off the command line, listed by the help, applied to the model config."""

import pytest
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

import titan_ext
from titan_ext.models import get_arch
from titan_ext.models.builder import build_model_config, configure_moe
from titan_ext.models.deepep import DeepEPV1TokenDispatcher
from titan_ext.models.experts import LeanTokenDispatcher
from titan_ext.models.fp8_experts import Fp8FeedForward, Fp8RoutedExperts
from titan_ext.options import TitanExtOptions, options_help, take_options

titan_ext.activate()  # the trainer's patches (patches/)


def test_flags_are_taken_out_and_the_rest_is_left_in_order():
    args = ["--training.steps", "3", "--titan_ext.dispatcher", "torchtitan", "--titan_ext.fp8",
            "--parallelism.expert_parallel_degree=2"]
    assert take_options(args) == TitanExtOptions(dispatcher="torchtitan", fp8=True)
    assert args == ["--training.steps", "3", "--parallelism.expert_parallel_degree=2"]
    args = ["--titan_ext.dispatcher=deepep"]
    assert take_options(args) == TitanExtOptions(dispatcher="deepep") and args == []
    assert take_options([]) == TitanExtOptions(dispatcher="lean", fp8=False, loss_chunks=1)
    assert take_options(["--titan_ext.loss_chunks", "8"]) == TitanExtOptions(loss_chunks=8)


def test_loss_chunks_wrap_torchtitans_loss_and_zero_is_refused():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from titan_ext.options import apply_options
    from titan_ext.train_config import trainer_config

    config = trainer_config("kimi_k2", "tiny")
    apply_options(config, TitanExtOptions(loss_chunks=4))
    assert isinstance(config.loss, ChunkedLossWrapper.Config) and config.loss.num_chunks == 4
    assert isinstance(config.loss.loss_fn, CrossEntropyLoss.Config)
    with pytest.raises(ValueError, match="--titan_ext.loss_chunks must be >= 1, got 0"):
        apply_options(trainer_config("kimi_k2", "tiny"), TitanExtOptions(loss_chunks=0))


def test_an_unknown_dispatcher_is_a_usage_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        take_options(["--titan_ext.dispatcher", "nccl"])
    assert e.value.code == 2
    assert "invalid choice: 'nccl' (choose from 'lean', 'torchtitan', 'deepep')" in capsys.readouterr().err


def test_help_lists_every_option():
    text = options_help()
    assert "--titan_ext.dispatcher {lean,torchtitan,deepep}" in text and "--titan_ext.fp8" in text
    assert "--titan_ext.loss_chunks N" in text


def _moe_layers(dispatcher, fp8):
    cfg = build_model_config(get_arch("kimi_k2", "tiny"))
    configure_moe(cfg, dispatcher=dispatcher, fp8=fp8)
    return [layer.moe for layer in cfg.layers if layer.moe is not None]


@pytest.mark.parametrize("name,cls", [("lean", LeanTokenDispatcher), ("torchtitan", AllToAllTokenDispatcher),
                                      ("deepep", DeepEPV1TokenDispatcher)])
def test_each_dispatcher_is_built_into_every_moe_layer(name, cls):
    layers = _moe_layers(name, False)
    assert layers and all(type(m.routed_experts.token_dispatcher) is cls.Config for m in layers)


def test_fp8_builds_fp8_routed_and_shared_experts():
    for m in _moe_layers("lean", True):
        assert type(m.routed_experts) is Fp8RoutedExperts.Config and type(m.shared_experts) is Fp8FeedForward.Config


def test_fp8_with_the_torchtitan_dispatcher_is_refused():
    with pytest.raises(ValueError, match="fp8 experts need the lean or deepep dispatcher, not torchtitan's"):
        _moe_layers("torchtitan", True)


def test_moerl_rl_takes_the_same_choices_in_its_trainer_config():
    from rl_loop.config import ConfigError, RLConfig
    from tests.conftest import ROOT

    toml = ROOT / "configs/tiny_kimi_k2.toml"
    train = RLConfig.from_toml(toml, {"train.dispatcher": "deepep", "train.fp8": True}).train
    assert (train.dispatcher, train.fp8) == ("deepep", True)
    assert (RLConfig.from_toml(toml).train.dispatcher, RLConfig.from_toml(toml).train.fp8) == ("lean", False)
    with pytest.raises(ConfigError, match="train.dispatcher"):
        RLConfig.from_toml(toml, {"train.dispatcher": "nccl"})


def test_loss_chunks_shard_the_norm_and_the_lm_head_as_units_of_their_own(monkeypatch):
    """The chunked loss reshards the LM head after its chunks; sharing an FSDP2 unit with the final norm, that
    frees the norm's weight before the decoder's backward on torch < 2.13 (the H200's 2.11). With the option on,
    TorchTitan's `fully_shard([norm, lm_head])` shards them one at a time; a tied embedding + head stays one unit."""
    import torch
    import torchtitan.distributed.fsdp as fsdp
    from titan_ext.chunked_loss import SEPARATE_HEAD_UNITS, _one_unit_per_module
    from titan_ext.options import apply_options
    from titan_ext.train_config import trainer_config

    calls = []
    split = _one_unit_per_module(lambda module, **kw: calls.append((module, kw)))
    norm, head, embed = torch.nn.LayerNorm(4), torch.nn.Linear(4, 8), torch.nn.Embedding(8, 4)
    split([norm, head], mesh="m", reshard_after_forward=False)
    assert calls == [(norm, {"mesh": "m", "reshard_after_forward": False}),
                     (head, {"mesh": "m", "reshard_after_forward": False})]
    calls.clear()
    head.weight = embed.weight
    split([embed, norm, head], mesh="m")
    assert len(calls) == 1 and calls[0][0] == [embed, norm, head]

    monkeypatch.setattr(fsdp, "fully_shard", getattr(fsdp.fully_shard, "__wrapped__", fsdp.fully_shard))
    apply_options(trainer_config("kimi_k2", "tiny"), TitanExtOptions(loss_chunks=1))
    assert getattr(fsdp.fully_shard, "_moerl_patch", None) is None
    apply_options(trainer_config("kimi_k2", "tiny"), TitanExtOptions(loss_chunks=4))
    assert getattr(fsdp.fully_shard, "_moerl_patch", None) == SEPARATE_HEAD_UNITS.name


def test_indexer_fp8_reaches_every_glm5_indexer_and_rl_turns_it_on():
    from types import SimpleNamespace

    from rl_loop.config import RLConfig
    from tests.conftest import ROOT
    from titan_ext.options import apply_options

    for flag in (False, True):
        cfg = SimpleNamespace(model_spec=SimpleNamespace(model=build_model_config(get_arch("glm5", "tiny"))))
        apply_options(cfg, take_options(["--titan_ext.indexer_fp8"] if flag else []))
        indexers = [layer.attention.indexer for layer in cfg.model_spec.model.layers]
        assert indexers and all(i.fp8_ranking is flag for i in indexers)
    assert RLConfig.from_toml(ROOT / "configs/tiny_glm5.toml").train.indexer_fp8 is True
