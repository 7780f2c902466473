"""The engine's host work per step stays flat in the number of parameters.

A small model's step is bound by the host: every operator the engine dispatches costs
microseconds of Python and C++ whatever its size, and a per-parameter loop multiplies that by
the parameter count (an 85M GPT has ~75 tensors; the non-finite vote alone used to dispatch
five operators per gradient). Counted here on CPU with a ``TorchDispatchMode``, over
``engine.backward`` (less the same model's plain autograd backward) and ``engine.step``, for
two models that differ only in their number of parameter tensors: the difference is the
engine's per-parameter work. Only operators that may launch a kernel count (views and
``detach`` are metadata). A structural count, not a timing: it fails when a per-parameter
loop comes back.

Also: under bf16 the host does not wait at ``engine.backward`` for the device to finish the
last step (to read its skip flag) when that flag has not landed yet; the run stays the same.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that only make a new view of existing storage (no kernel on a device).
VIEWS = {
    "aten.view",
    "aten._unsafe_view",
    "aten.detach",
    "aten.slice",
    "aten.select",
    "aten.t",
    "aten.transpose",
    "aten.expand",
    "aten.reshape",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.as_strided",
    "aten.alias",
    "aten.split",
    "aten.permute",
    "profiler._record_function_enter_new",
    "profiler._record_function_exit",
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _Stack(nn.Module):
    """``layers`` residual blocks of LayerNorm + Linear (four parameter tensors each)."""

    def __init__(self, layers: int, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(layers)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return ((self.head(x).float() - y) ** 2).mean()


def _counts(stage: int, bf16: bool, layers: int) -> tuple[int, int, int]:
    """(engine.backward's operators beyond plain autograd, engine.step's, parameter tensors)
    of the third step (the first steps create optimizer state)."""
    import slipstream

    torch.manual_seed(0)
    model = _Stack(layers)
    plain = copy.deepcopy(model)
    dtype = torch.bfloat16 if bf16 else torch.float32
    plain.to(dtype)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        # fused: the multi-tensor AdamW a GPU gets by default (one kernel for all tensors)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "fused": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "check_grad_overflow": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 1)
    try:
        for _ in range(3):
            loss = engine(x, y)
            with _Count() as backward:
                engine.backward(loss)
            with _Count() as step:
                engine.step()
        reference = plain(x, y)
        with _Count() as autograd:
            reference.backward()
    finally:
        engine.destroy()
    extra = sum(backward.ops.values()) - sum(autograd.ops.values())
    return extra, sum(step.ops.values()), len(list(model.parameters()))


# (stage, bf16) -> (backward operators per parameter tensor, step operators per tensor).
# Stage 0 under bf16 moves each gradient into its fp32 master as autograd produces it (one
# cast each); stages 1-2 copy each into its reduce bucket as it arrives (DDP's overlap).
PER_PARAMETER = {
    (0, False): (0, 0),
    (0, True): (1, 0),
    (1, False): (1, 0),
    (1, True): (1, 0),
    (2, False): (1, 0),
    (2, True): (1, 0),
}
# The step's operators whatever the model (vote, norm, clip, fused AdamW, master copy-back):
# a bound with some room for torch versions, far below a per-parameter loop's.
STEP_BOUND = 40


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_engine_host_dispatches_do_not_grow_with_parameters(stage: int, bf16: bool) -> None:
    small_backward, small_step, small_params = _counts(stage, bf16, layers=2)
    large_backward, large_step, large_params = _counts(stage, bf16, layers=8)
    more = large_params - small_params
    backward_each, step_each = PER_PARAMETER[(stage, bf16)]
    summary = (
        f"stage {stage} {'bf16' if bf16 else 'fp32'}: backward +{small_backward} / "
        f"+{large_backward}, step {small_step} / {large_step} for {small_params} / "
        f"{large_params} parameter tensors"
    )
    assert large_step - small_step <= step_each * more, summary
    assert large_backward - small_backward <= backward_each * more, summary
    assert large_step <= STEP_BOUND, summary


def _train_with_a_bad_step(ready: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """bf16, fused AdamW, a WarmupLR schedule, the non-finite check; step 1's gradient is
    non-finite. ``ready``: whether the last step's flag copy counts as landed at backward."""
    import slipstream
    from slipstream.comm.testing import count_host_reads
    from slipstream.runtime.step_flag import FlagCopy

    monkeypatch.setattr(FlagCopy, "ready", lambda self: ready)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "fused": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "bf16": {"enabled": True},
    }
    engine, *_ = slipstream.initialize(model=_Stack(2), config=config)
    reads, deferred, lrs = [0], 0, []
    # The LR each optimizer step runs with (the schedule moves when the last step settles).
    engine.optimizer.register_step_pre_hook(
        lambda optimizer, *_: lrs.append(optimizer.param_groups[0]["lr"])
    )
    try:
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, generator=g, dtype=torch.bfloat16), torch.randn(4, 1)
            loss = engine(x, y)
            if step == 1:
                loss = loss + torch.sqrt(next(engine.module.parameters()).sum() * 0.0)
            with count_host_reads(reads):
                engine.backward(loss)
            deferred += engine._unsettled is not None
            engine.step()
        weights = [p.detach().float().clone() for p in engine.module.parameters()]
        return weights, engine.skipped_steps, lrs, reads[0], deferred
    finally:
        engine.destroy()


def test_bf16_backward_does_not_wait_for_the_last_steps_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a loss scale, a skip flag still on its way to the host is read at the next
    step() instead of at backward (which would wait for the device to finish the last step);
    the run is the same: the bad step skipped, the LR schedule held back by it, same weights."""
    waited = _train_with_a_bad_step(True, monkeypatch)
    ahead = _train_with_a_bad_step(False, monkeypatch)
    assert waited[1] == ahead[1] == 1  # the non-finite step was skipped
    assert waited[2] == ahead[2]  # the LR each step used
    assert all(torch.equal(a, b) for a, b in zip(waited[0], ahead[0]))
    assert waited[3] == 4 and waited[4] == 0  # read at each backward after the first step
    assert ahead[3] == 0 and ahead[4] == 4  # never at backward: every step's is left for step()
