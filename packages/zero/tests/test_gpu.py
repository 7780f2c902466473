"""Stage 1-3 on one accelerator (a group of one): storage resizing and casts on the device."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.zero import (
    GatheredParameters,
    ShardedOptimizerStates,
    ZeroSettings,
    shard_parameters,
)
from slipstream.zero.testing import TinyTransformer, batch_for

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("stage", [2, 3])
def test_stage_on_device_matches_plain_pytorch(stage: int) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.01)
    settings = ZeroSettings(stage=stage, param_persistence_numel=0, reduce_bucket_numel=1000)
    if stage == 3:
        zero = shard_parameters(model, settings, device=device).attach_optimizer(optimizer)
    else:
        zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
    for step in range(3):
        ids, labels = (t.to(device) for t in batch_for(step, 0, 4))
        model(ids, labels).backward()
        zero.finish_backward()
        zero.optimizer.step(max_grad_norm=1.0)
        zero.zero_grad()
        reference(ids, labels).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    with GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-4, atol=1e-5)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first queues ~0.1 s of GPU sleep on the compute stream, so
    the host hands every gradient bucket over long before the GPU has produced it."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(100_000_000)
        return grad


class _SlowNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 512)
        self.b = torch.nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(self.b(torch.relu(self.a(x)))).square().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_gradients_reach_the_host_intact_on_one_device(stage: int) -> None:
    """Optimizer offload in a group of one: the side stream that copies each reduced bucket
    to the host must wait for the compute stream (there is no collective to wait for).
    Before that wait, the host received the bucket before the GPU had written it."""
    pytest.importorskip("slipstream.offload")
    from slipstream.offload.settings import OptimizerOffload

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = _SlowNet().to(device)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    settings = ZeroSettings(
        stage=stage,
        param_persistence_numel=0,
        reduce_bucket_numel=40_000,  # several buckets, each handed over during backward
        offload_optimizer=OptimizerOffload(device="cpu", pin_memory=True),
    )
    if stage == 3:
        zero = shard_parameters(model, settings, device=device).attach_optimizer(optimizer)
    else:
        zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
    assert zero.reducer.num_buckets > 1
    for step in range(2):
        x = torch.randn(64, 256, device=device) * (step + 1)
        model(x).backward()
        zero.finish_backward()
        reference(x).backward()
        for i, (master, ref) in enumerate(zip(zero.masters.masters, reference.parameters())):
            assert master.device.type == "cpu" and master.grad is not None
            got = master.grad.reshape(-1)[: ref.numel()]
            assert torch.equal(got, ref.grad.reshape(-1).cpu()), (stage, step, i)
        zero.zero_grad()
        reference.zero_grad()
