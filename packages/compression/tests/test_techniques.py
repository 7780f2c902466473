"""Each technique on a small model: bits, STE gradients, schedules, pruned shapes and outputs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.compression import (
    CompressionScheduler,
    LinearCompress,
    init_compression,
    redundancy_clean,
)
from slipstream.compression.quantizers import quantized_values
from slipstream.compression.testing import LAYER_REDUCTION_DOCS, deepspeed_config, tiny_bert


def _wq(bits: int, target: int | None = None, **shared: Any) -> dict[str, Any]:
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, **shared},
                "different_groups": {
                    "wq1": {
                        "params": {
                            "start_bits": bits,
                            "target_bits": bits if target is None else target,
                            "quantization_period": 3,
                        },
                        "modules": ["*"],
                    }
                },
            }
        }
    }


@pytest.mark.parametrize(
    "bits,symmetric", [(8, True), (4, True), (4, False), (3, True), (2, True), (1, True)]
)
def test_weights_hold_at_most_2_to_the_bits_values_per_group(bits: int, symmetric: bool) -> None:
    torch.manual_seed(0)
    groups = 4
    w = torch.randn(16, 32)
    q = quantized_values(w, bits, groups, symmetric=symmetric)
    for group in q.reshape(groups, -1):
        assert group.unique().numel() <= 2**bits
    if 3 <= bits <= 4:  # a coarse grid: 128 normal draws use more than half its levels
        assert q.reshape(groups, -1)[0].unique().numel() > 2 ** (bits - 1)
    # Quantizing again changes nothing (the values are on the grid).
    torch.testing.assert_close(quantized_values(q, bits, groups, symmetric=symmetric), q)


def test_ste_passes_the_gradient_straight_through() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    init_compression(model, _wq(4, quantize_groups=8))
    layer = model[0]
    assert isinstance(layer, LinearCompress) and layer.weight_bits == 4
    x = torch.randn(5, 16)
    layer(x).square().sum().backward()
    # Reference: the same loss with the quantized weight as a leaf; the STE hands its
    # gradient to the full-precision weight unchanged.
    q = quantized_values(layer.weight, 4, 8).requires_grad_()
    F.linear(x, q, layer.bias).square().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    torch.testing.assert_close(layer.weight.grad, q.grad)


def test_weight_bits_follow_offset_and_period() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    config = _wq(8, 5, schedule_offset=4)
    init_compression(model, config)
    scheduler = CompressionScheduler(model, config)
    layer = model[0]
    assert isinstance(layer, LinearCompress)
    seen = []
    for _ in range(16):
        seen.append(layer.weight_bits)
        scheduler.step()
    # Off before step 4; then one bit fewer every 3 steps down to 5.
    assert seen == [None] * 4 + [8, 8, 8, 7, 7, 7, 6, 6, 6, 5, 5, 5]
    x = torch.randn(3, 8)
    fresh = nn.Linear(8, 8)
    fresh.load_state_dict(layer.state_dict())
    expected = F.linear(x, quantized_values(fresh.weight, 5, 1), fresh.bias)
    torch.testing.assert_close(layer(x), expected)


def test_pruning_starts_at_its_offset_and_gradual_sparsity_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10))
    config = {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": {
                    "enabled": True,
                    "method": "l1",
                    "schedule_offset": 2,
                    "schedule_offset_end": 6,
                    "schedule_offset_stride": 2,
                },
                "different_groups": {"sp1": {"params": {"dense_ratio": 0.2}}},
            }
        }
    }
    init_compression(model, config)
    scheduler = CompressionScheduler(model, config)
    x = torch.eye(10)
    kept = []
    for _ in range(8):
        out = model(x) - model[0].bias  # rows of the effective weight, transposed
        kept.append(int((out != 0).sum()))
        scheduler.step()
    # 100 weights: all kept before step 2, then 100% -> 20% in strides of 2 steps.
    assert kept == [100, 100, 100, 100, 60, 60, 20, 20]
    # The kept weights are the largest.
    weight = model[0].weight.detach()
    mask = (model(x) - model[0].bias).T != 0
    assert weight[mask].abs().min() >= weight[~mask].abs().max()


def test_row_and_head_pruning_shrink_shapes_and_keep_the_masked_outputs() -> None:
    model = tiny_bert()
    config = deepspeed_config()
    init_compression(model, config)
    scheduler = CompressionScheduler(model, config)
    for _ in range(450):  # past every offset; bits reach their targets (12 -> 8 and 4)
        scheduler.step()
    tokens = torch.randint(0, 64, (2, 9))
    masked = model(tokens).logits
    layer = model.bert.encoder.layer[0]  # type: ignore[union-attr]
    assert layer.attention.self.query.weight_bits == 8
    assert layer.attention.output.dense.weight_bits == 4
    redundancy_clean(model, config)
    # intermediate 96 -> 48 rows and output.dense 96 -> 48 columns; 12 heads -> 6.
    assert layer.intermediate.dense.weight.shape == (48, 48)
    assert layer.output.dense.weight.shape == (48, 48)
    assert layer.attention.self.query.weight.shape == (24, 48)
    assert layer.attention.self.value.bias.shape == (24,)
    assert layer.attention.output.dense.weight.shape == (48, 24)
    assert model.config.intermediate_size == 48  # type: ignore[union-attr]
    assert model.config.num_attention_heads == 6  # type: ignore[union-attr]
    torch.testing.assert_close(model(tokens).logits, masked, rtol=1e-5, atol=1e-6)
    # Sparse pruning is in the weights now: half of each Q/K/V weight is zero.
    query = layer.attention.self.query.weight
    assert 0.4 < float((query == 0).float().mean()) < 0.6


def test_channel_pruning_removes_conv_channels_and_their_norms() -> None:
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(torch.relu(self.bn1(self.conv1(x))))

    model = nn.Sequential()
    model.add_module("layer1", nn.Sequential(Block()))
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # a norm whose pruned channels output nothing
            module.bias.data.zero_()
    config = {
        "compression_training": {
            "channel_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
                "different_groups": {
                    "cp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["layer....conv1"],
                        "related_modules": [["layer....conv2", "layer....bn1"]],
                    }
                },
            }
        }
    }
    init_compression(model, config)
    x = torch.randn(2, 3, 6, 6)
    masked = model(x)
    redundancy_clean(model, config)
    block = model.layer1[0]
    assert block.conv1.weight.shape == (4, 3, 3, 3)
    assert block.bn1.running_mean.shape == (4,)
    assert block.conv2.weight.shape == (4, 4, 3, 3)
    torch.testing.assert_close(model(x), masked, rtol=1e-5, atol=1e-6)


def test_layer_reduction_from_a_teacher_and_in_place() -> None:
    teacher = tiny_bert(layers=12, heads=4, seed=1)
    student = tiny_bert(layers=5, heads=4, seed=2)
    config = {"compression_training": {"layer_reduction": LAYER_REDUCTION_DOCS}}
    init_compression(student, config, teacher_model=teacher)
    for kept, source in zip(student.bert.encoder.layer, [2, 4, 6, 8, 10]):  # type: ignore[union-attr]
        for (name, a), (_, b) in zip(
            kept.state_dict().items(),
            teacher.bert.encoder.layer[source].state_dict().items(),  # type: ignore[union-attr]
        ):
            assert torch.equal(a, b), name
    torch.testing.assert_close(
        student.classifier.weight,
        teacher.classifier.weight,  # type: ignore[union-attr]
    )
    # Without a teacher, the model itself is cut to the listed layers.
    model = copy.deepcopy(teacher)
    init_compression(model, config)
    assert len(model.bert.encoder.layer) == 5  # type: ignore[union-attr]
    assert model.config.num_hidden_layers == 5  # type: ignore[union-attr]
    tokens = torch.randint(0, 64, (1, 6))
    torch.testing.assert_close(model(tokens).logits, student(tokens).logits)


def test_qat_trains_with_an_optimizer_built_before_init_compression() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = _wq(4, quantize_groups=4)
    init_compression(model, config)
    scheduler = CompressionScheduler(model, config)
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(30):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_conv1d_layers_become_equal_linears() -> None:
    from transformers.pytorch_utils import Conv1D

    from slipstream.compression.helper import convert_conv1d_to_linear

    torch.manual_seed(0)
    model = nn.ModuleList([Conv1D(12, 8) for _ in range(2)])  # DeepSpeed's test: a list of them
    x = torch.randn(3, 8)
    expected = [layer(x) for layer in model]
    convert_conv1d_to_linear(model, Conv1D)
    for layer, want in zip(model, expected):
        assert type(layer) is nn.Linear
        torch.testing.assert_close(layer(x), want)


def test_mixed_quantize_static_activations_and_stochastic_rounding() -> None:
    torch.manual_seed(0)
    # fp16_mixed_quantize: the forward blends toward the quantized weight by the change ratio.
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    config = _wq(3, fp16_mixed_quantize={"enabled": True, "quantize_change_ratio": 0.25})
    init_compression(model, config)
    scheduler = CompressionScheduler(model, config)
    weight = model[0].weight.detach().clone()
    q = quantized_values(weight, 3, 1)
    for step in range(5):
        expected = min(1.0, 0.25 * step) * q + (1 - min(1.0, 0.25 * step)) * weight
        torch.testing.assert_close(model[0].compressed_weight()[0], expected)
        scheduler.step()
    # Static activation ranges: a running range in training, frozen in eval.
    layer = nn.Sequential(nn.Linear(4, 2))
    init_compression(
        layer,
        {
            "compression_training": {
                "activation_quantization": {
                    "shared_parameters": {
                        "enabled": True,
                        "schedule_offset": 0,
                        "range_calibration": "static",
                    },
                    "different_groups": {"aq1": {"params": {"bits": 4}}},
                }
            }
        },
    )
    linear = layer[0]
    layer.train()
    layer(torch.full((2, 4), 1.0))
    layer(torch.full((2, 4), 3.0))
    _, high = linear.static_range
    assert float(high) == pytest.approx(0.95 * 1.0 + 0.05 * 3.0)
    layer.eval()
    layer(torch.full((2, 4), 100.0))
    assert float(linear.static_range[1]) == float(high)
    # Stochastic rounding stays on the grid and is unbiased on average.
    x = torch.full((4000,), 0.3)
    x[0] = 1.0  # absmax 1, step 1/7 at 4 bits: 0.3 lies between 2/7 and 3/7
    values = quantized_values(x, 4, 1, stochastic=True)
    assert set((values * 7).round().unique().tolist()) <= {2.0, 3.0, 7.0}
    assert float(values[1:].mean()) == pytest.approx(0.3, abs=0.01)
