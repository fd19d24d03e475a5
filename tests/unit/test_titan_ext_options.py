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


def test_loss_chunks_are_refused_where_fsdp2_cannot_run_them(monkeypatch):
    """On torch without FSDP2's partial forward of the norm + LM-head unit (the H200's 2.11) the first backward
    fails inside torch; the option is refused before anything is built, naming the version it needs."""
    import titan_ext.options as options
    from titan_ext.train_config import trainer_config

    monkeypatch.setattr(options, "CHUNKED_LOSS_TORCH", "torch>=99")
    with pytest.raises(ValueError, match=r"--titan_ext.loss_chunks 4: the chunked LM head \+ loss needs torch>=99 "
                                         r"\(FSDP2 partial forward .*\); found torch 2\.\d+"):
        options.apply_options(trainer_config("kimi_k2", "tiny"), TitanExtOptions(loss_chunks=4))


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
