"""HostOptimizer: the C++ CPU step matches the torch optimizer it replaces, state for state."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.kernels.optim import Lion
from slipstream.offload.host_optimizer import HostOptimizer, kernel_for
from slipstream.offload.settings import OptimizerOffload

SHAPES = [(7, 13), (1,), (4097,), (3, 5, 2)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


FACTORIES = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05),
    "adam-groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2], "weight_decay": 0.0}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2
    ),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01),
    "lion": lambda ps: Lion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-groups": lambda ps: torch.optim.SGD(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}], lr=0.1, momentum=0.9
    ),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("sub_group_numel", [10, 1_000_000])
def test_matches_torch_step_for_step(name: str, sub_group_numel: int) -> None:
    reference = _params(0)
    offloaded = [torch.nn.Parameter(p.detach().clone()) for p in reference]
    ref_opt = FACTORIES[name](reference)
    opt = FACTORIES[name](offloaded)
    copies = {id(p): torch.empty(p.shape, dtype=torch.bfloat16) for p in offloaded}
    host = HostOptimizer(
        opt, OptimizerOffload(sub_group_numel=sub_group_numel), copies=copies, announce=False
    )
    assert (host.kernel is None) == name.startswith("sgd")
    seen: list[int] = []
    for step in range(4):
        _grads(reference, step)
        _grads(offloaded, step)
        ref_opt.step()
        host.step(on_sub_group=lambda chunk: seen.append(len(chunk)))
        for r, o in zip(reference, offloaded):
            # Unit-scale weights: 1e-6 absolute is fp32 rounding of a few fused multiply-adds.
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(copies[id(o)], o.detach().to(torch.bfloat16), rtol=0, atol=0)
    assert sum(seen) == 4 * len(SHAPES)
    if sub_group_numel == 10:
        assert len(host.sub_groups) > 1
    # The state has torch's keys and values: a checkpoint loads into the device optimizer.
    ref_state = ref_opt.state_dict()["state"]
    state = opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for index in ref_state:
        assert ref_state[index].keys() == state[index].keys()
        for key, value in ref_state[index].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(state[index][key], value, rtol=1e-6, atol=1e-6)
            else:
                assert state[index][key] == value
    fresh = FACTORIES[name](copy.deepcopy(reference))
    fresh.load_state_dict(opt.state_dict())


def test_unsupported_flags_fall_back() -> None:
    params = _params(1)
    assert kernel_for(torch.optim.AdamW(params, amsgrad=True))[0] is None
    assert kernel_for(torch.optim.Adagrad(params, lr_decay=0.1))[0] is None
    assert kernel_for(torch.optim.AdamW(params))[0] == "adam"
    one_group = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "amsgrad": True}])
    assert kernel_for(one_group)[0] is None


def test_rejects_device_or_low_precision_params() -> None:
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        HostOptimizer(torch.optim.AdamW(params), OptimizerOffload(), announce=False)


def test_thread_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.offload.threads import THREADS_ENV, choose_threads

    monkeypatch.setenv(THREADS_ENV, "3")
    assert choose_threads().threads == 3
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    choice = choose_threads(1.0)
    assert choice.threads >= 1 and "torchrun" in choice.reason
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert choose_threads().threads == 1  # the user's own OMP_NUM_THREADS is respected
    # `slipstream run` set it (and says so): a launcher default, like torchrun's.
    monkeypatch.setenv("SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED", "1")
    choice = choose_threads(1.0)
    assert "slipstream run" in choice.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # changed by the user after the launcher
    assert choose_threads().threads == 2
    monkeypatch.setenv(THREADS_ENV, "zero")
    with pytest.raises(ValueError, match=THREADS_ENV):
        choose_threads()
