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
