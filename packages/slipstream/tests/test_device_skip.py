"""The non-finite vote decided on the device: no host read of the flag in ``engine.step()``.

With a fused optimizer (torch's ``fused=True`` Adam/AdamW/SGD take a ``found_inf`` flag into
their kernels), the engine steps without asking the host whether the step is skipped; the
flag is read later (before the next backward, or by the counters). Counted here on CPU by
wrapping every Python-level host read of a tensor (``item``, ``bool``, ``float``, ``int``,
``tolist``) while ``engine.step()`` runs; the same run with a non-fused optimizer must read
the flag on the host (so the counter would catch a read that comes back). Each case trains
beside a twin that never sees the poisoned micro-batch: the skip must be exact, the ranks
must agree, fp16's loss scale must back off.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import count_host_reads, run_distributed

STEPS = 4
BAD = 1


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float(), y)


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _state(engine: Any) -> list[torch.Tensor]:
    return [
        v.detach().float().clone()
        for s in engine.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]


def _worker(cases: list[tuple[str, int, bool]]) -> list[str]:
    import slipstream
    from slipstream import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    problems: list[str] = []
    for precision, stage, fused in cases:
        name = f"{precision} stage {stage} {'fused' if fused else 'foreach'} world {world}"
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 1.0,
            "steps_per_print": 10_000,
            "zero_optimization": {"stage": stage},
        }
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        runs = []
        torch.manual_seed(0)
        model = Tiny()
        for _ in range(2):
            copy = Tiny()
            copy.load_state_dict(model.state_dict())
            optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-2, fused=fused)
            runs.append(slipstream.initialize(model=copy, optimizer=optimizer, config=config)[0])
        engine, twin = runs
        reads = [0]
        scale_before = engine.cur_scale
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            if step == BAD:
                before, state_before = _weights(engine), _state(engine)
                loss = engine(x, y)
                if rank == world - 1:  # poisoned on one rank: every rank must skip
                    loss = loss + torch.sqrt(next(engine.module.parameters()).sum() * 0.0)
                engine.backward(loss)
                with count_host_reads(reads):
                    engine.step()
                if not all(torch.equal(b, a) for b, a in zip(before, _weights(engine))):
                    problems.append(f"{name}: the skipped step changed the weights")
                after = _state(engine)
                if len(after) != len(state_before) or not all(
                    torch.equal(b, a) for b, a in zip(state_before, after)
                ):
                    problems.append(f"{name}: the skipped step changed the optimizer state")
                if engine.skipped_steps != 1:
                    problems.append(f"{name}: skipped_steps {engine.skipped_steps}")
                if precision == "fp16" and engine.cur_scale != scale_before / 2:
                    problems.append(f"{name}: scale {scale_before} -> {engine.cur_scale}")
                continue
            for run in (engine, twin):
                run.backward(run(x, y))
                with count_host_reads(reads) if run is engine else _null():
                    run.step()
        if fused and reads[0]:
            problems.append(f"{name}: engine.step() read a tensor on the host {reads[0]} times")
        if not fused and not reads[0]:
            problems.append(f"{name}: the non-fused step did not read the flag (counter broken)")
        final, expected = _weights(engine), _weights(twin)
        if not all(torch.equal(f, e) for f, e in zip(final, expected)):
            problems.append(f"{name}: differs from the run without the bad batch")
        gathered = [torch.zeros(len(final)) for _ in range(world)]
        torch.distributed.all_gather(gathered, torch.stack([f.sum() for f in final]))
        if not all(torch.equal(gathered[0], other) for other in gathered):
            problems.append(f"{name}: ranks disagree")
        if engine.skipped_steps != 1 or twin.skipped_steps != 0:
            problems.append(f"{name}: skipped {engine.skipped_steps}, {twin.skipped_steps}")
        engine.destroy()
        twin.destroy()
    return problems


@contextmanager
def _null() -> Any:
    yield


_CASES = [
    ("fp32", 0, True),
    ("fp32", 0, False),
    ("fp16", 0, True),
    ("fp32", 2, True),
    ("fp16", 1, True),
]


def test_the_skip_is_decided_on_the_device_without_a_host_read() -> None:
    results = run_distributed(_worker, 2, _CASES, timeout=300)
    problems = [p for rank_problems in results for p in rank_problems]
    assert not problems, "\n".join(problems)


def _gathered_weights(engine: Any) -> list[torch.Tensor]:
    """The full weights (stage 3: gathered; its sharded parameters have no storage outside)."""
    from slipstream.zero import GatheredParameters

    params = list(engine.module.parameters())
    if engine.zero_stage != 3:
        return _weights(engine)
    with GatheredParameters(params):
        return _weights(engine)


def _where(error: BaseException) -> str:
    """The innermost Slipstream frame of ``error``'s traceback (file:line code)."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "slipstream" in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/src/', 1)[-1]}:{frame.lineno} {frame.line}"


def _no_sync_on_gpu(stage: int) -> list[str]:
    """bf16, AdamW from the config (fused on CUDA), clipping, the default non-finite check:
    ``engine.step()`` under ``torch.cuda.set_sync_debug_mode("error")``; a poisoned step is
    still skipped exactly. Each problem names the stage, the step and where it happened."""
    import slipstream
    from slipstream import comm

    rank = comm.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    torch.manual_seed(0)
    engine, *_ = slipstream.initialize(model=Tiny(), config=config)
    problems = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=g).to(device), torch.randint(0, 3, (4,), generator=g)
        loss = engine(x, y.to(device))
        if step == BAD:
            before = _gathered_weights(engine)
            if stage == 3:  # its parameters have no storage outside forward and backward
                loss = loss * float("nan")
            else:  # a finite loss whose gradient is not
                loss = loss + torch.sqrt(next(engine.module.parameters()).sum() * 0.0)
        engine.backward(loss)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.step()
        except RuntimeError as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            problems.append(f"stage {stage} step {step}: {first} at {_where(error)}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # a kernel's fault shows here, at its step
        if step == BAD and not all(
            torch.equal(b, a) for b, a in zip(before, _gathered_weights(engine))
        ):
            problems.append(f"stage {stage}: the skipped step changed the weights")
    if engine.skipped_steps != 1:
        problems.append(f"stage {stage}: skipped_steps {engine.skipped_steps}")
    engine.destroy()
    return problems


def _no_sync_worker() -> list[str]:
    problems: list[str] = []
    for stage in (0, 1, 2, 3):
        try:
            problems += _no_sync_on_gpu(stage)
        except Exception as error:  # a CUDA fault ends the process's use of the device
            first = str(error).splitlines()[0] if str(error) else ""
            problems.append(f"stage {stage}: {type(error).__name__}: {first} at {_where(error)}")
            break
    return problems


@pytest.mark.gpu
def test_engine_step_does_not_synchronize_on_gpus() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    world = min(2, torch.cuda.device_count())
    results = run_distributed(_no_sync_worker, world, backend="nccl", timeout=300)
    problems = [f"rank {r}: {p}" for r, rank_problems in enumerate(results) for p in rank_problems]
    assert not problems, "\n".join(problems)
