"""Activation checkpointing: same gradients with dropout, RNG replay, options, config block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.kernels.config_schema import ConfigError
from slipstream.pipeline import checkpointing
from slipstream.pipeline.rng import RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed


@pytest.fixture(autouse=True)
def _reset():
    checkpointing.reset()
    yield
    checkpointing.reset()


class _Block(nn.Module):
    """Dropout from torch's generator and from the tracker's model-parallel stream."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 8)

    def forward(self, x):
        h = nn.functional.dropout(torch.relu(self.first(x)), 0.5, training=True)
        with get_rng_tracker().fork():
            h = nn.functional.dropout(h, 0.3, training=True)
        return self.second(h)


def _grads(use_checkpoint, **options):
    checkpointing.reset()
    if options:
        checkpointing.configure(None, **options)
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    model_parallel_manual_seed(123)
    out = checkpointing.checkpoint(block, x) if use_checkpoint else block(x)
    # Draw more random numbers before backward: recomputation must not see them.
    torch.rand(100)
    with get_rng_tracker().fork():
        torch.rand(100)
    out.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"checkpoint_in_cpu": True},
        {"synchronize": True, "profile": True},
        {"partition_activations": True},  # one tensor-parallel rank: nothing to split
    ],
)
def test_checkpoint_gives_the_same_gradients_with_dropout(options):
    expected = _grads(False)
    got = _grads(True, **options)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_rng_replay_the_gradients_would_differ():
    # The check above is meaningful only if a fresh mask changes the gradients.
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8)
    model_parallel_manual_seed(123)
    first = block(x)
    second = block(x)
    assert not torch.equal(first, second)


def test_reentrant_mode_and_keyword_arguments():
    torch.manual_seed(1)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpointing.checkpoint(layer, x, use_reentrant=True)
    out.sum().backward()
    expected = torch.ones(2, 4) @ layer.weight
    torch.testing.assert_close(x.grad, expected)
    y = checkpointing.non_reentrant_checkpoint(lambda a, b: a * b, torch.ones(2), torch.ones(2))
    assert y.tolist() == [1.0, 1.0]


def test_profile_counts_forwards_and_recomputations():
    checkpointing.configure(profile=True)
    layer = nn.Linear(4, 4)
    for _ in range(3):
        checkpointing.checkpoint(layer, torch.randn(2, 4, requires_grad=True)).sum().backward()
    summary = checkpointing.profile_summary()
    assert summary.forward_calls == 3 and summary.recompute_calls == 3
    assert summary.forward_seconds > 0 and summary.recompute_seconds > 0


def test_configure_reads_the_config_block():
    assert not checkpointing.is_configured()
    config = checkpointing.configure(
        deepspeed_config={
            "train_batch_size": 1,
            "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4},
        }
    )
    assert checkpointing.is_configured()
    assert config.cpu_checkpointing and config.number_checkpoints == 4
    assert checkpointing.get_config() == config
    # Keyword arguments override the block.
    assert not checkpointing.configure(
        deepspeed_config=config, checkpoint_in_cpu=False
    ).cpu_checkpointing


def test_config_errors():
    with pytest.raises(
        ConfigError, match=r"did you mean 'activation_checkpointing\.cpu_checkpointing'"
    ):
        checkpointing.configure(deepspeed_config={"cpu_checkpoint": True})
    # Nothing is partitioned with one tensor-parallel rank: accepted (DeepSpeed configs set it).
    assert checkpointing.configure(contiguous_checkpointing=True).contiguous_memory_optimization

    class TwoWayTensorParallel:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(TypeError, match="get_model_parallel_group"):
        checkpointing.configure(TwoWayTensorParallel(), partition_activations=True)
    # No preallocated buffer: accepted and logged as having no effect, at any TP size.
    assert checkpointing.configure(
        TwoWayTensorParallel(), contiguous_checkpointing=True
    ).contiguous_memory_optimization
    with pytest.raises(TypeError, match="config dict"):
        checkpointing.configure(deepspeed_config="ds.json")


def test_rng_tracker():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="does not exist"):
        with tracker.fork("missing"):
            pass
    outer = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    with tracker.fork("a"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the stream advances
    saved = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), third)
    # Different tensor-parallel ranks get different model-parallel streams.
    model_parallel_manual_seed(7, tensor_parallel_rank=0)
    with get_rng_tracker().fork():
        rank0 = torch.rand(4)
    model_parallel_manual_seed(7, tensor_parallel_rank=1)
    with get_rng_tracker().fork():
        rank1 = torch.rand(4)
    assert not torch.equal(rank0, rank1)


@pytest.mark.gpu
def test_cpu_checkpointing_moves_saved_inputs_off_the_accelerator():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm device")
    layer = nn.Linear(4096, 4096, device="cuda")

    def saved_bytes(cpu):
        checkpointing.reset()
        checkpointing.configure(checkpoint_in_cpu=cpu)
        x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
        h = x * 2  # an intermediate: only the checkpoint keeps it alive after `del`
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = checkpointing.checkpoint(layer, h)
        del h
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.sum().backward()
        torch.testing.assert_close(
            x.grad, (torch.ones(4096, 4096, device="cuda") @ layer.weight) * 2
        )
        return held

    on_device, on_host = saved_bytes(False), saved_bytes(True)
    assert on_device - on_host >= 4096 * 4096 * 4  # the saved input lives on the host
