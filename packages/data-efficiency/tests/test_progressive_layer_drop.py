"""Progressive layer drop: theta(t) equals DeepSpeed's formula; per-layer keep rates and skipping."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.data import (
    ProgressiveLayerDrop,
    ProgressiveLayerDropConfig,
    layer_keep_probability,
    run_layers_with_drop,
)
from slipstream.kernels.config_schema import ConfigError


@pytest.mark.parametrize("theta", [0.0, 0.1, 0.9, 1.0])
def test_theta_schedule_equals_deepspeeds_formula(theta: float) -> None:
    gamma = 0.001
    pld = ProgressiveLayerDrop(theta, gamma)
    assert pld.get_theta() == 1.0  # before the first update
    for step in range(0, 3000, 37):
        pld.update_state(step)
        assert pld.get_theta() == (1.0 - theta) * math.exp(-gamma * step) + theta
        assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}


def test_config_defaults_and_bad_values() -> None:
    config = ProgressiveLayerDropConfig.from_dict({"enabled": True})
    assert (config.theta, config.gamma) == (0.5, 0.001)
    assert ProgressiveLayerDrop.from_config(ProgressiveLayerDropConfig()) is None
    with pytest.raises(ConfigError, match="theta"):
        ProgressiveLayerDropConfig.from_dict({"enabled": True, "theta": 1.5})
    with pytest.raises(ConfigError, match="gamma"):
        ProgressiveLayerDropConfig.from_dict({"gamma": -1})


def test_layer_keep_probability_decreases_with_depth() -> None:
    assert layer_keep_probability(0, 4, 0.5) == 1.0 - 1 / 4 * 0.5
    assert layer_keep_probability(3, 4, 0.5) == 0.5  # the last layer keeps theta
    assert layer_keep_probability(2, 4, 1.0) == 1.0
    with pytest.raises(ValueError, match="layer_index 4"):
        layer_keep_probability(4, 4, 0.5)


def test_layers_are_skipped_at_their_keep_rate_and_run_all_in_eval() -> None:
    calls = [0, 0, 0, 0]

    def make(index: int):
        def layer(hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            calls[index] += 1
            return hidden + scale * (index + 1)

        return layer

    layers = [make(i) for i in range(4)]
    generator = torch.Generator().manual_seed(0)
    trials = 4000
    for _ in range(trials):
        run_layers_with_drop(layers, torch.zeros(1), pld_theta=0.2, training=True,
                             generator=generator)  # fmt: skip
    for index, count in enumerate(calls):
        expected = layer_keep_probability(index, 4, 0.2) * trials
        assert abs(count - expected) < 4 * math.sqrt(trials * 0.25), (index, count, expected)
    # Same generator seed, same layers skipped (what keeps data-parallel ranks in step).
    outs = [
        run_layers_with_drop(layers, torch.zeros(1), pld_theta=0.2, training=True,
                             generator=torch.Generator().manual_seed(7), scale=2.0)
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert run_layers_with_drop(layers, torch.zeros(1), pld_theta=0.0, training=False) == 10
    assert run_layers_with_drop(layers, torch.zeros(1), pld_theta=None, training=True) == 10
