"""PipelineModule in one process: building, partitioning, tying, checkpointing, running."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from slipstream.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from slipstream.pipeline.models import DecoderBlock, decoder_layer_specs, language_model_loss
from slipstream.pipeline.partition import balanced_partition, uniform_partition


def test_uniform_partition():
    assert uniform_partition(10, 4) == [0, 3, 6, 8, 10]
    assert uniform_partition(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        uniform_partition(3, 0)


def _brute_force(weights, parts):
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = [0, *cuts, len(weights)]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = heaviest if best is None else min(best, heaviest)
    return best


def test_balanced_partition_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        weights = [rng.choice([0, 1, 2, 5, 7.5]) for _ in range(n)]
        parts = rng.randint(1, n)
        bounds = balanced_partition(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == parts + 1
        assert all(a < b for a, b in itertools.pairwise(bounds)), (weights, parts, bounds)
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest == _brute_force(weights, parts)


def _specs(**kwargs):
    return decoder_layer_specs(vocab_size=32, hidden=16, layers=4, heads=2, ffn=24, **kwargs)


def test_partition_methods_on_virtual_parts():
    # One rank with four chunks: four parts, enough to see each method at work.
    specs = _specs()
    uniform = PipelineModule(specs, num_stages=1, partition_method="uniform", virtual_stages=4)
    assert uniform.parts == [0, 2, 4, 6, 7]
    by_type = PipelineModule(specs, num_stages=1, partition_method="type:decoder", virtual_stages=4)
    blocks_per_part = [
        sum(isinstance(s, LayerSpec) and s.typename is DecoderBlock for s in specs[a:b])
        for a, b in itertools.pairwise(by_type.parts)
    ]
    assert blocks_per_part == [1, 1, 1, 1]
    by_params = PipelineModule(specs, num_stages=1, partition_method="parameters", virtual_stages=4)
    # Parameters: embedding 512, each block 2208, norm 16, head 512. The heaviest part can be
    # no lighter than block 4 + norm + head (2736): [emb, b1] [b2] [b3] [b4, norm, head].
    assert by_params.parts == [0, 2, 3, 4, 7]
    counts = [
        sum(
            p.numel()
            for i in by_params.stage_layers(c)
            for p in getattr(by_params, str(i)).parameters()
        )
        for c in range(4)
    ]
    assert counts == [2720, 2208, 2208, 2736]
    with pytest.raises(ValueError, match="partition_method"):
        PipelineModule(specs, num_stages=1, partition_method="best-effort")
    with pytest.raises(ValueError, match="matches 0 layers"):
        PipelineModule(specs, num_stages=1, partition_method="type:conv", virtual_stages=2)
    with pytest.raises(ValueError, match="profile_inputs"):
        PipelineModule(specs, num_stages=1, partition_method="profile", virtual_stages=2)


def test_profile_partition_puts_the_slow_layer_alone():
    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            for _ in range(200):
                x = torch.tanh(self.linear(x))
            return x

    layers = [LayerSpec(nn.Linear, 64, 64) for _ in range(3)] + [LayerSpec(Slow)]
    module = PipelineModule(
        layers,
        num_stages=1,
        partition_method="profile",
        virtual_stages=2,
        profile_inputs=torch.randn(8, 64),
    )
    assert module.parts == [0, 3, 4]


def test_seed_layers_makes_weights_independent_of_the_partitioning():
    one = PipelineModule(_specs(), num_stages=1, seed_layers=True)
    four = PipelineModule(_specs(), num_stages=1, seed_layers=True, virtual_stages=4)
    torch.manual_seed(99)  # would change unseeded construction
    again = PipelineModule(_specs(), num_stages=1, seed_layers=True, virtual_stages=2)
    for other in (four, again):
        a, b = one.state_dict(), other.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_layers_share_one_module_on_one_rank():
    module = PipelineModule(_specs(tie_embeddings=True), num_stages=1, seed_layers=True)
    names = [n for n, _ in module.named_parameters()]
    assert "tied_modules.embed.weight" in names
    assert not any(n.startswith("0.") or n.startswith(f"{len(_specs()) - 1}.") for n in names)
    ids = torch.randint(0, 32, (2, 5))
    logits = module(ids)
    assert logits.shape == (2, 5, 32)
    language_model_loss(logits, ids).backward()
    # One weight receives the gradient of both uses.
    assert module.tied_modules["embed"].weight.grad is not None


def test_layer_forms_and_errors():
    module = PipelineModule(
        [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), lambda x: x * 2, LayerSpec(nn.Linear, 4, 1)],
        num_stages=1,
    )
    x = torch.randn(3, 4)
    expected = getattr(module, "3")(torch.relu(getattr(module, "0")(x)) * 2)
    assert torch.equal(module(x), expected)
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        LayerSpec(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"LayerSpec, nn\.Module or callable"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), 42], num_stages=1)
    with pytest.raises(ValueError, match="cannot fill"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, virtual_stages=2)
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)])
    with pytest.raises(RuntimeError, match="init_distributed"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 2, num_stages=2)
    spec = TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=["weight", "bias"])
    assert spec.tied_weight_attr == ["weight", "bias"]


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_activation_checkpoint_interval_gives_the_same_gradients(interval):
    specs = _specs(dropout=0.1)
    plain = PipelineModule(specs, num_stages=1, seed_layers=True, loss_fn=language_model_loss)
    checked = PipelineModule(
        specs,
        num_stages=1,
        seed_layers=True,
        loss_fn=language_model_loss,
        activation_checkpoint_interval=interval,
    )
    ids = torch.randint(0, 32, (2, 6))
    grads = []
    for module in (plain, checked):
        torch.manual_seed(5)  # the same dropout masks in both runs
        language_model_loss(module(ids), ids).backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def test_checkpointable_layers_restricts_what_is_checkpointed():
    calls = []

    def counting_checkpoint(fn, *args):
        calls.append(fn)
        return fn(*args)

    module = PipelineModule(
        _specs(),
        num_stages=1,
        activation_checkpoint_interval=1,
        activation_checkpoint_func=counting_checkpoint,
        checkpointable_layers=["DecoderBlock"],
    )
    module(torch.randint(0, 32, (1, 4)))
    assert len(calls) == 4  # the four blocks, not the embedding, norm or head
    with torch.no_grad():
        module(torch.randint(0, 32, (1, 4)))
    assert len(calls) == 4  # no checkpointing without autograd
