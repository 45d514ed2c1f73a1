"""The training build applies ``train.activation_checkpointing`` to the model the step runs (not
to the EMA copy); an unknown block name stops the build with a ConfigError naming the key."""
from __future__ import annotations

import pytest

from fastvision import config, engine
from fastvision.errors import ConfigError
from fastvision.models.checkpointing import is_checkpointed


def _build(spec):
    cfg = config.load("unet2d-microscopy", [{"train": {"activation_checkpointing": spec, "device": "cpu",
                                                      "ema_decay": 0.9}}])
    return engine.build(cfg, data_info={}, train=True)


def test_build_checkpoints_the_named_blocks_of_the_trained_model():
    run = _build(["decoders"])
    wrapped = [n for n, m in run.model.named_modules() if is_checkpointed(m)]
    assert wrapped == ["decoders.0", "decoders.1", "decoders.2", "decoders.3"]
    assert not any(is_checkpointed(m) for m in run.step.ema.modules())  # evaluation copy: plain forward
    assert not any(is_checkpointed(m) for m in _build(False).model.modules())


def test_unknown_block_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing: unknown block 'decoder'.*decoders.0"):
        _build(["decoder"])
