"""Random-LTD: kept tokens get the full layer's output, dropped ones pass through; token ops."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from slipstream.data import (
    RandomLayerTokenDrop,
    RandomLTDConfig,
    RandomLTDScheduler,
    attach_random_ltd,
    convert_to_random_ltd,
    gather_tokens,
    remove_random_ltd_state_dict,
    scatter_tokens,
)
from slipstream.data.config import LayerTokenLRScheduleConfig
from slipstream.data.random_ltd import LayerTokenLR, layer_token_lr
from slipstream.data.random_ltd.token_ops import (
    flat_token_indices,
    gather_tokens_reference,
    scatter_tokens_reference,
)


class TokenwiseLayer(nn.Module):
    """A per-token layer (an MLP): its output at a token depends on that token only, so the
    full layer's output at the kept tokens is the reference for the dropped run."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple:
        self.seen_mask = attention_mask
        return hidden + self.mlp(hidden), "extra"


class Stack(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TokenwiseLayer(width) for _ in range(layers))

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=attention_mask)[0]
        return hidden


def _config(layer_ids: list[int], total: int, order: str = "batch_seq_dim") -> RandomLTDConfig:
    return RandomLTDConfig.from_dict(
        {"enabled": True, "total_layer_num": total, "random_ltd_layer_num": len(layer_ids),
         "random_ltd_layer_id": layer_ids, "model_mask_name": "attention_mask",
         "model_type": "decoder", "hidden_state_order": order,
         "random_ltd_schedule": {"min_value": 4, "max_value": 12,
                                 "schedule_config": {"require_steps": 8, "seq_per_step": 2}}}
    )  # fmt: skip


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_kept_tokens_equal_the_full_layer_and_dropped_pass_through(order: str) -> None:
    torch.manual_seed(0)
    width, seq, batch = 8, 12, 3
    layer = TokenwiseLayer(width)
    wrapped = RandomLayerTokenDrop(layer)
    config = _config([0], 1, order)
    scheduler = RandomLTDScheduler(config, global_batch_size=batch)
    wrapped.init_config(config, scheduler, 0, backend="torch")
    scheduler.update_seq(0)  # keeps 4 of 12 tokens
    hidden = (
        torch.randn(batch, seq, width)
        if order == "batch_seq_dim"
        else torch.randn(seq, batch, width)
    )
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).expand(batch, 1, seq, seq)
    out, extra = wrapped(hidden, attention_mask=mask)
    assert extra == "extra"
    assert layer.seen_mask.shape == (batch, 1, 4, 4)  # decoder: the causal prefix block
    full = layer(hidden)[0]
    bsh = (lambda t: t) if order == "batch_seq_dim" else (lambda t: t.transpose(0, 1))
    indices = scheduler.sample_indices[0]
    assert indices.shape == (batch, 4)
    assert torch.equal(indices, indices.sort(dim=1).values)
    kept = torch.zeros(batch, seq, dtype=torch.bool)
    kept.scatter_(1, indices.long(), True)
    torch.testing.assert_close(bsh(out)[kept], bsh(full)[kept], rtol=0, atol=0)
    assert torch.equal(bsh(out)[~kept], bsh(hidden)[~kept])
    # Gradients: dropped tokens get the output's gradient unchanged, kept ones the layer's.
    hidden.requires_grad_(True)
    grad_out = torch.randn_like(out)
    (out_again,) = [wrapped(hidden, attention_mask=mask)[0]]
    indices = scheduler.sample_indices[0]
    kept = torch.zeros(batch, seq, dtype=torch.bool).scatter_(1, indices.long(), True)
    (grad,) = torch.autograd.grad(out_again, hidden, grad_out)
    (grad_full,) = torch.autograd.grad(layer(hidden)[0], hidden, grad_out)
    torch.testing.assert_close(bsh(grad)[kept], bsh(grad_full)[kept])
    assert torch.equal(bsh(grad)[~kept], bsh(grad_out)[~kept])


def test_encoder_masks_keep_the_kept_rows_and_columns() -> None:
    torch.manual_seed(3)
    layer = TokenwiseLayer(4)
    wrapped = RandomLayerTokenDrop(layer)
    config = RandomLTDConfig.from_dict(
        {**_config([0], 1).to_dict(), "model_type": "encoder"}, "random_ltd"
    )
    scheduler = RandomLTDScheduler(config, 2)
    wrapped.init_config(config, scheduler, 0, backend="torch")
    scheduler.update_seq(0)  # keeps 4
    mask = torch.randn(2, 1, 12, 12)
    wrapped(torch.randn(2, 12, 4), attention_mask=mask)
    indices = scheduler.sample_indices[0].long()
    for b in range(2):
        expected = mask[b, :, indices[b]][:, :, indices[b]]
        assert torch.equal(layer.seen_mask[b], expected)


def test_eval_and_full_length_run_the_whole_layer() -> None:
    layer = TokenwiseLayer(4)
    wrapped = RandomLayerTokenDrop(layer)
    config = _config([0], 1)
    scheduler = RandomLTDScheduler(config, 2)
    wrapped.init_config(config, scheduler, 0)
    hidden = torch.randn(2, 12, 4)
    scheduler.update_seq(100)  # schedule done: keeps max_value = 12 = seq
    assert torch.equal(wrapped(hidden)[0], layer(hidden)[0])
    scheduler.set_current_seq(4)
    wrapped.eval()
    assert torch.equal(wrapped(hidden)[0], layer(hidden)[0])


def test_convert_attach_shares_indices_and_state_dict_names() -> None:
    model = Stack(4, 4)
    names_before = set(model.state_dict())
    convert_to_random_ltd(model, TokenwiseLayer)
    config = _config([1, 2], 4)
    scheduler = RandomLTDScheduler(config, 2)
    # Only layers 1 and 2 are in random_ltd_layer_id: unwrap the others' scheduler.
    assert attach_random_ltd(model, config, scheduler) == ["layers.1", "layers.2"]
    assert set(remove_random_ltd_state_dict(model.state_dict())) == names_before
    scheduler.update_seq(0)
    scheduler.sample_indices = None
    model(torch.randn(2, 12, 4))
    assert scheduler.sample_indices is not None and scheduler.sample_indices.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="random_ltd_layer_num"):
        attach_random_ltd(model, _config([1, 2, 7], 8), scheduler)


def test_token_ops_reference_backward_matches_autograd() -> None:
    hidden = torch.randn(2, 6, 3, requires_grad=True)
    indices = torch.tensor([[0, 2, 5], [1, 3, 4]])
    part = gather_tokens(hidden, indices, backend="torch")
    assert torch.equal(part[1, 2], hidden[1, 4])
    merged = scatter_tokens(hidden, part * 2, indices, backend="torch")
    assert torch.equal(merged[0, 2], hidden[0, 2] * 2) and torch.equal(merged[0, 1], hidden[0, 1])


def test_row_index_token_ops_equal_the_gather_scatter_references_and_their_grads() -> None:
    torch.manual_seed(4)
    hidden = torch.randn(3, 9, 5)
    part = torch.randn(3, 4, 5)
    indices = torch.rand(3, 9).argsort(1)[:, :4].sort(1).values
    grad_out = torch.randn(3, 9, 5)
    results = []
    for ops in ("rows", "reference"):
        h, p = hidden.clone().requires_grad_(True), part.clone().requires_grad_(True)
        if ops == "rows":
            rows = flat_token_indices(indices, 9)
            gathered = gather_tokens(h, indices, "torch", rows)
            merged = scatter_tokens(h, p * gathered, indices, "torch", rows)
        else:
            gathered = gather_tokens_reference(h, indices)
            merged = scatter_tokens_reference(h, p * gathered, indices)
        merged.backward(grad_out)
        results.append((gathered, merged, h.grad, p.grad))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_token_ops_match_the_reference(dtype: torch.dtype) -> None:
    from slipstream.data.random_ltd.token_ops import triton_available

    if not triton_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    hidden = torch.randn(3, 10, 40, dtype=dtype, device=device)
    indices = torch.rand(3, 10, device=device).argsort(1)[:, :4].sort(1).values.to(torch.int32)
    part = torch.randn(3, 4, 40, dtype=dtype, device=device)
    results = {}
    for backend in ("torch", "triton"):
        h = hidden.clone().requires_grad_(True)
        p = part.clone().requires_grad_(True)
        gathered = gather_tokens(h, indices, backend=backend)
        merged = scatter_tokens(h, p + gathered, indices, backend=backend)
        merged.float().square().sum().backward()
        results[backend] = (gathered, merged, h.grad, p.grad)
    for reference, kernel in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(kernel, reference, rtol=0, atol=0)


def test_layer_token_lr_warms_up_and_decays_over_layer_tokens() -> None:
    settings = LayerTokenLRScheduleConfig.from_dict(
        {"enabled": True, "total_layer_tokens": 1000, "warmup_layer_tokens": 100}
    )
    assert layer_token_lr(1.0, 50, settings) == 0.5
    assert layer_token_lr(1.0, 100, settings) == 1.0
    assert layer_token_lr(1.0, 550, settings) == pytest.approx(0.5)
    assert layer_token_lr(1.0, 5000, settings) == pytest.approx(0.0)
    config = _config([0], 2)
    scheduler = RandomLTDScheduler(config, global_batch_size=1)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = LayerTokenLR(optimizer, scheduler, settings)
    scheduler.update_seq(0)  # 4 + 12 layer-tokens
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 16 / 100)


_AOT_SCRIPT = """
from slipstream.kernels.aot import compile_spec
from slipstream.data.random_ltd.token_triton import aot_specs
failed = [
    (spec.name, target, result.error)
    for spec in aot_specs() if "bf16" in spec.name
    for target in ("sm_90", "gfx942")
    for result in [compile_spec(spec, target)] if not result.ok
]
assert not failed, failed
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_token_kernels_compile_ahead_of_time_for_nvidia_and_amd() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
