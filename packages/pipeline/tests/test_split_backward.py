"""The zero-bubble split: input gradients, then weight gradients, equal one plain backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.pipeline import PipelineModule
from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
from slipstream.pipeline.split_backward import backward_input, backward_weight

SPECS = decoder_layer_specs(32, 16, 3, 2, 24, tie_embeddings=True)


def _stage(interval):
    # One rank, two chunks: chunk 1 (blocks 2-3, norm, tied head) is a "later stage" whose
    # input arrives from chunk 0, like the receiving side of a pipeline.
    return PipelineModule(
        SPECS,
        num_stages=1,
        virtual_stages=2,
        partition_method="uniform",
        seed_layers=True,
        activation_checkpoint_interval=interval,
    )


@pytest.mark.parametrize(("interval", "split"), [(0, True), (1, True), (1, False)])
def test_split_equals_plain_backward(interval, split):
    module = _stage(interval)
    assert module.stage_layers(1) == [3, 4, 5]
    weights = [p for p in module.parameters() if p.requires_grad]
    hidden = torch.randn(2, 6, 16)
    labels = torch.randint(0, 32, (2, 6))

    def run():
        x = hidden.clone().requires_grad_(True)
        return x, language_model_loss(module(x, chunk=1), labels)

    x, loss = run()
    loss.backward()
    expected = [x.grad.clone(), *(p.grad.clone() if p.grad is not None else None for p in weights)]
    module.zero_grad(set_to_none=True)

    x, loss = run()
    # The executor asks for split=False on checkpointed stages (one recomputation instead of
    # one per consumer); both ways must give the plain gradients.
    (dx,), pending = backward_input([loss], None, [x], weights, split=split)
    assert (pending.fallback is None) == split
    assert bool(pending.consumers) == split
    assert all(p.grad is None for p in weights)  # nothing touched the weights yet
    backward_weight(pending)
    got = [dx, *(p.grad for p in weights)]
    for a, b in zip(expected, got):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_side_branches_and_weights_not_behind_the_input():
    bias = nn.Parameter(torch.randn(3))
    layer = nn.Linear(3, 3)
    weights = [bias, *layer.parameters()]
    x = torch.randn(2, 3, requires_grad=True)
    grad = torch.randn(2, 3)
    bias_grad = grad.sum(0) * 2 * (1 - torch.tanh(bias.detach()) ** 2)

    # A weight on a side branch joins the input's path at the add: captured there.
    out = layer(x) + torch.tanh(bias) * 2
    (dx,), pending = backward_input([out], [grad], [x], weights)
    assert pending.fallback is None
    backward_weight(pending)
    torch.testing.assert_close(dx, grad @ layer.weight)
    torch.testing.assert_close(bias.grad, bias_grad)
    torch.testing.assert_close(layer.weight.grad, grad.t() @ x)

    # An output that does not depend on the input at all: the weight pass re-traverses.
    for w in weights:
        w.grad = None
    outputs = [layer(x), torch.tanh(bias) * 2]
    (dx,), pending = backward_input(outputs, [grad, grad.sum(0)], [x], weights)
    assert pending.fallback is not None
    backward_weight(pending)
    torch.testing.assert_close(dx, grad @ layer.weight)
    torch.testing.assert_close(bias.grad, bias_grad)
    torch.testing.assert_close(layer.weight.grad, grad.t() @ x)
