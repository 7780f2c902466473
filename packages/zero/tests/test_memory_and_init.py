"""Bytes held per rank shrink as each stage promises; zero.Init never builds the whole model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed


def _bytes(tensors) -> int:
    from slipstream.zero.testing import param_bytes

    return param_bytes([t for t in tensors if t is not None])


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    states = [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return _bytes([v for v in states if v.dim() > 0])


def _account(stage: int) -> dict:
    """Train one step at ``stage`` (0: plain PyTorch); measure bytes held by each kind."""
    from slipstream.zero import (
        DataParallelGroup,
        ShardedOptimizerStates,
        ZeroSettings,
        shard_parameters,
    )
    from slipstream.zero.testing import TinyTransformer, batch_for

    torch.manual_seed(0)
    model = TinyTransformer(dim=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    settings = ZeroSettings(
        stage=max(stage, 1), reduce_bucket_numel=4096, param_persistence_numel=0
    )
    group = DataParallelGroup.of()
    sharded = None
    if stage == 3:
        sharded = shard_parameters(model, settings)
        zero = sharded.attach_optimizer(optimizer)
    elif stage in (1, 2):
        zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
    ids, labels = batch_for(0, group.rank, 2)
    loss = model(ids, labels)
    loss.backward()
    if stage:
        zero.finish_backward(is_boundary=True)
    params = list(model.parameters())
    model_grads = _bytes([p.grad for p in params])
    if stage:
        zero.optimizer.step()
        masters = zero.masters.masters
        master_grads = _bytes([m.grad for m in masters])
        master_bytes = _bytes(masters)
    else:
        optimizer.step()
        master_grads = master_bytes = 0
    param_storage = _bytes(params)
    if sharded is not None:
        # The shards are the parameters' only copy at stage 3 (fp32: they are the masters).
        param_storage = sum(p.untyped_storage().nbytes() for p in params)
        param_storage += _bytes([s.shard for s in sharded.sharded])
    return {
        "params": param_storage,
        "grads": model_grads + master_grads,
        "optimizer": _optimizer_bytes(optimizer) + (master_bytes if stage in (1, 2) else 0),
        "full_params": sum(p.numel() * 4 for p in params),
        "trainable": sum(p.numel() * 4 for p in params if p.requires_grad),
    }


def _init_and_gather() -> dict:
    """zero.Init peak memory, GatheredParameters edits, external parameters in forward."""
    from slipstream.zero import (
        GatheredParameters,
        Init,
        ZeroSettings,
        register_external_parameter,
        shard_parameters,
        sharded_state_of,
    )
    from slipstream.zero.group import DataParallelGroup

    group = DataParallelGroup.of()
    world = group.world_size
    layers, width = 6, 48
    live: dict[int, torch.nn.Parameter] = {}
    peak = 0

    def registered(module, name, param):
        nonlocal peak
        if param is not None:
            live[id(param)] = param
        held = sum(p.untyped_storage().nbytes() for p in live.values())
        shards = sum(
            sharded_state_of(p).shard.untyped_storage().nbytes()
            for p in live.values()
            if sharded_state_of(p) is not None
        )
        peak = max(peak, held + shards)

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.scale = nn.Parameter(torch.ones(width))
            register_external_parameter(self, self.layers[0].weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            # Reads layer 0's weight outside layer 0: declared above as external.
            return F.linear(x * self.scale, self.layers[0].weight).sum()

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(registered)
    try:
        torch.manual_seed(group.rank)  # different on each rank: Init must broadcast rank 0's
        with Init():
            model = Tower()
    finally:
        handle.remove()
    layer_bytes = (width * width + width) * 4
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    shard_bytes = sum(sharded_state_of(p).shard.numel() * 4 for p in model.parameters())
    storage_after = sum(p.untyped_storage().nbytes() for p in model.parameters())

    with GatheredParameters(list(model.parameters())):
        full = [p.detach().clone() for p in model.parameters()]
    # Plain reference with the same (gathered) weights.
    reference = Tower.__new__(Tower)
    nn.Module.__init__(reference)
    reference.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
    reference.scale = nn.Parameter(torch.ones(width))
    with torch.no_grad():
        for p, value in zip(reference.parameters(), full):
            p.copy_(value)

    sharded = shard_parameters(model, ZeroSettings(stage=3, param_persistence_numel=0))
    zero = sharded.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(5))
    out = model(x)
    out.backward()
    zero.finish_backward()
    ref_out = reference(x)
    ref_out.backward()
    grad_diff = 0.0
    for p, master, spec_param in zip(zero.params, zero.masters.masters, reference.parameters()):
        shard = sharded_state_of(p).spec.shard_of(spec_param.grad, group.rank)
        # Averaged over ranks: each rank fed the same x, so the mean equals one rank's grad.
        grad_diff = max(grad_diff, float((master.grad - shard).abs().max()))

    with GatheredParameters(model.layers[1].weight, modifier_rank=0):
        if group.rank == 0:
            with torch.no_grad():
                model.layers[1].weight.fill_(0.5)
    with GatheredParameters(model.layers[1].weight):
        edited = float(model.layers[1].weight.detach().sum())
    return {
        "peak": peak,
        "bound": shard_bytes + layer_bytes,
        "total": total_bytes,
        "storage_after": storage_after,
        "first_full": full[1][0, :3].tolist(),
        "out_diff": abs(float(out) - float(ref_out)),
        "grad_diff": grad_diff,
        "edited": edited,
        "expected_edit": 0.5 * width * width,
        "world": world,
    }


def _memory_world2() -> dict:
    results = {stage: _account(stage) for stage in (0, 1, 2, 3)}
    results["init"] = _init_and_gather()
    return results


def test_bytes_per_rank_shrink_by_stage_and_init_stays_small() -> None:
    per_rank = run_distributed(_memory_world2, 2, timeout=300)
    for result in per_rank:
        plain, s1, s2, s3 = (result[s] for s in (0, 1, 2, 3))
        full, trainable = plain["full_params"], plain["trainable"]
        slack = 64 * 4 * 2  # padding: under one element per parameter tensor per kind
        # Stage 0 (plain PyTorch): full params, full grads, two full Adam moments.
        assert plain["params"] == full and plain["grads"] == trainable
        assert plain["optimizer"] == 2 * trainable
        # Stage 1: optimizer states (two moments + fp32 master) for half the elements.
        assert s1["optimizer"] <= 3 * trainable / 2 + slack
        assert s1["params"] == full
        # Stage 2: gradients live only as the owned shard after backward.
        assert s2["grads"] <= trainable / 2 + slack
        assert s2["optimizer"] <= 3 * trainable / 2 + slack
        # Stage 3: parameters too (the fp32 shards double as masters).
        assert s3["params"] <= full / 2 + slack
        assert s3["grads"] <= trainable / 2 + slack and s3["optimizer"] <= trainable + slack

        init = result["init"]
        assert init["storage_after"] == 0
        assert init["peak"] <= init["bound"] < init["total"], init
        assert init["out_diff"] <= 1e-5 and init["grad_diff"] <= 1e-6, init
        assert init["edited"] == init["expected_edit"]
    # Every rank holds rank 0's initial values, though each seeded its RNG differently.
    assert per_rank[0]["init"]["first_full"] == per_rank[1]["init"]["first_full"]
