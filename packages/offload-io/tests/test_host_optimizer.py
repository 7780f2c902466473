"""HostOptimizer: the C++ CPU step matches the torch optimizer it replaces, state for state."""

from __future__ import annotations

import copy
import math

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


@pytest.mark.parametrize("name", ["adamw", "sgd"])  # one group: the same lr for the rest
def test_steps_only_the_params_it_is_given(name: str) -> None:
    # Partial offload: the optimizer holds every master, the host step only the offloaded ones
    # (a parameter left out keeps its value and state, whatever its .grad says).
    reference = _params(0)
    offloaded = [torch.nn.Parameter(p.detach().clone()) for p in reference]
    ref_opt = FACTORIES[name](reference[1:])
    opt = FACTORIES[name](offloaded)
    host = HostOptimizer(opt, OptimizerOffload(sub_group_numel=10), announce=False,
                         params=offloaded[1:])  # fmt: skip
    assert [id(p) for p in host.params] == [id(p) for p in offloaded[1:]]
    assert sum(len(chunk) for chunk in host.sub_groups) == len(SHAPES) - 1
    before = offloaded[0].detach().clone()
    for step in range(3):
        _grads(reference, step)
        _grads(offloaded, step)
        ref_opt.step()
        host.step()
        for r, o in zip(reference[1:], offloaded[1:]):
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    assert torch.equal(offloaded[0], before) and not opt.state[offloaded[0]]
    assert host.spare_bytes() == 12 * sum(p.numel() for p in offloaded[1:])
    with pytest.raises(ValueError, match="parameters of the optimizer"):
        HostOptimizer(opt, OptimizerOffload(), announce=False, params=[torch.zeros(2)])


def test_partial_offload_settings_are_checked() -> None:
    assert OptimizerOffload(ratio=0.3).ratio == 0.3
    with pytest.raises(ValueError, match="must be in"):
        OptimizerOffload(ratio=1.5)
    with pytest.raises(ValueError, match="needs device='cpu'"):
        OptimizerOffload(device="nvme", nvme_path="/tmp", ratio=0.5)


def test_thread_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.offload.threads import choose_threads

    choice = choose_threads(threads=3)  # offload_optimizer.threads
    assert choice.threads == 3 and "offload_optimizer.threads" in choice.reason
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
    with pytest.raises(ValueError, match=r"offload_optimizer\.threads=-1"):
        choose_threads(threads=-1)
    with pytest.raises(ValueError, match="cpu_schedule='guided'"):
        OptimizerOffload(cpu_schedule="guided")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads=-2"):
        OptimizerOffload(threads=-2)


# -- speculative steps (out of place, then committed or discarded) ---------------------------
def _pair(name: str = "adam-groups") -> tuple[HostOptimizer, HostOptimizer]:
    """Two HostOptimizers over equal copies of the same parameters, with bf16 copies."""
    hosts = []
    for _ in range(2):
        params = _params(3)
        copies = {id(p): torch.empty(p.shape, dtype=torch.bfloat16) for p in params}
        optimizer = FACTORIES[name](params)
        hosts.append(HostOptimizer(optimizer, OptimizerOffload(), copies=copies, announce=False))
    return hosts[0], hosts[1]


def _all_params(host: HostOptimizer) -> list[torch.Tensor]:
    return [p for group in host.optimizer.param_groups for p in group["params"]]


def _snapshot(host: HostOptimizer) -> list[torch.Tensor]:
    out = []
    for p in _all_params(host):
        out.append(p.detach().clone())
        out.append(host.copies[id(p)].clone())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in host.optimizer.state[p]:
                out.append(torch.as_tensor(host.optimizer.state[p][key]).clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_committed_speculation_is_the_in_place_step_bit_for_bit() -> None:
    speculating, stepping = _pair()
    assert speculating.can_speculate
    identities = [id(p) for p in _all_params(speculating)]
    spare_ids: set[int] = set()
    for step in range(4):
        for host in (speculating, stepping):
            _grads(_all_params(host), step)
        masters_before = [p.detach().clone() for p in _all_params(speculating)]
        states_before = [dict(speculating.optimizer.state[p]) for p in _all_params(speculating)]
        params = _all_params(speculating)
        speculating.speculate_params(params[:2])  # in two parts, as buckets arrive
        speculating.speculate_params(params[2:])
        assert speculating.speculation_pending
        # Nothing live has moved yet: masters, states and step counts.
        assert _same(masters_before, [p.detach() for p in params])
        for p, before in zip(params, states_before):
            if before:
                assert speculating.optimizer.state[p]["step"] == before["step"]
        assert speculating.commit_speculation(1.0)
        assert not speculating.speculation_pending
        stepping.step()
        assert _same(_snapshot(speculating), _snapshot(stepping)), step
        # The masters keep their identity; the buffers alternate between two sets.
        assert [id(p) for p in _all_params(speculating)] == identities
        spare_ids |= {p.data_ptr() for p in _all_params(speculating)}
    assert len(spare_ids) == 2 * len(SHAPES)


@pytest.mark.parametrize("change", ["lr", "grad_scale", "missing", "zero_grad", "stepped"])
def test_speculation_is_refused_unless_it_is_exactly_the_step(change: str) -> None:
    speculating, stepping = _pair()
    for host in (speculating, stepping):
        _grads(_all_params(host), 0)
        host.step()  # states exist: a refused commit must leave them as they are
        _grads(_all_params(host), 1)
    params = _all_params(speculating)
    speculating.speculate_params(params if change != "missing" else params[1:])
    grad_scale = 1.0
    if change == "lr":  # e.g. a scheduler stepped between backward and the step
        for host in (speculating, stepping):
            host.optimizer.param_groups[1]["lr"] = 5e-3
    elif change == "grad_scale":  # the norm asked for clipping
        grad_scale = 0.5
    elif change == "zero_grad":
        for host in (speculating, stepping):
            for p in _all_params(host):
                p.grad = None
    elif change == "stepped":
        for host in (speculating, stepping):
            host.step()
            _grads(_all_params(host), 2)
    masters = [p.detach().clone() for p in _all_params(speculating)]
    states = [t.clone() for p in _all_params(speculating)
              for t in speculating.optimizer.state[p].values()]  # fmt: skip
    assert not speculating.commit_speculation(grad_scale)
    assert not speculating.speculation_pending
    assert _same([p.detach() for p in _all_params(speculating)], masters)
    assert _same(
        [t for p in _all_params(speculating) for t in speculating.optimizer.state[p].values()],
        states,
    )
    if change == "zero_grad":  # no step follows: the copies go back to the masters
        speculating.refresh_copies()
    else:
        speculating.step(grad_scale=grad_scale)
        stepping.step(grad_scale=grad_scale)
    assert _same(_snapshot(speculating), _snapshot(stepping))


def test_discarded_speculation_leaves_everything_and_only_adam_speculates() -> None:
    speculating, stepping = _pair()
    _grads(_all_params(speculating), 0)
    speculating.speculate_params(_all_params(speculating))
    assert speculating.discard_speculation()
    assert not speculating.discard_speculation()
    assert not speculating.commit_speculation(1.0)  # nothing pending
    assert _same(
        [p.detach() for p in _all_params(speculating)],
        [p.detach() for p in _all_params(stepping)],
    )
    assert speculating.spare_bytes() == 12 * sum(math.prod(s) for s in SHAPES)
    lion = HostOptimizer(FACTORIES["lion"](_params(0)), OptimizerOffload(), announce=False)
    assert not lion.can_speculate
    with pytest.raises(RuntimeError, match="speculative steps need the C\\+\\+ Adam"):
        lion.speculate_params(_all_params(lion))


def _scheduler_moves_on(host: HostOptimizer) -> None:
    for group in host.optimizer.param_groups:
        group["lr"].fill_(1.0)  # a tensor lr is updated in place
        if "betas" in group:
            group["betas"] = (0.5, 0.5)


class _Recording:
    """The C++ ops with each Adam call's keyword arguments recorded."""

    def __init__(self, ops: object) -> None:
        self.ops, self.calls = ops, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.ops, name)

    def adam(self, *args: object, **kwargs: object) -> None:
        self.calls.append(kwargs)
        self.ops.adam(*args, **kwargs)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "memory",
    [
        {"cpu_stores": "mixed"},
        {"cpu_stores": "stream"},
        {"cpu_stores": "stream", "cpu_prefetch": 1024},
    ],
)
def test_memory_settings_change_no_bit(memory: dict) -> None:
    """offload_optimizer.cpu_stores / cpu_prefetch reach the C++ Adam and change how
    it moves memory only: steps and committed speculations equal the default's bit for bit."""
    hosts = []
    for settings in (OptimizerOffload(), OptimizerOffload(**memory)):
        params = _params(3)
        copies = {id(p): torch.empty(p.shape, dtype=torch.bfloat16) for p in params}
        optimizer = FACTORIES["adam-groups"](params)
        hosts.append(HostOptimizer(optimizer, settings, copies=copies, announce=False))
    default, chosen = hosts
    recording = _Recording(chosen._ops)
    chosen._ops = recording
    for step in range(3):
        for host in hosts:
            _grads(_all_params(host), step)
        if step == 1:  # a speculative step, committed
            chosen.speculate_params(_all_params(chosen))
            assert chosen.commit_speculation(1.0)
        else:
            chosen.step()
        default.step()
        assert _same(_snapshot(default), _snapshot(chosen)), step
    calls = recording.calls
    assert calls and all(k["stores"] == memory["cpu_stores"] for k in calls)
    assert all(k["prefetch"] == memory.get("cpu_prefetch", 0) for k in calls)
    with pytest.raises(ValueError, match="cpu_prefetch=-1"):
        OptimizerOffload(cpu_prefetch=-1)
    with pytest.raises(ValueError, match="cpu_stores='fast'"):
        OptimizerOffload(cpu_stores="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["adam-groups", "adagrad", "lion"])
def test_frozen_hyperparameters_outlast_a_scheduler(name: str) -> None:
    """overlap_forward: steps taken after freeze_hyperparameters() use the groups' settings
    of that moment, whatever a scheduler writes meanwhile; after thaw_hyperparameters() the
    live ones again."""
    frozen, reference = _pair(name)
    for host in (frozen, reference):
        for group in host.optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]))
        _grads(_all_params(host), 0)
    params = _all_params(frozen)
    frozen.step_params(params[:1])  # before the freeze: the live settings
    frozen.freeze_hyperparameters()
    _scheduler_moves_on(frozen)
    frozen.step_params(params[1:])  # after it: still the settings of the freeze
    reference.step()
    assert _same(_snapshot(frozen), _snapshot(reference))
    if name == "adam-groups":  # a speculation is checked against the frozen settings
        for host in (frozen, reference):
            _grads(_all_params(host), 1)
        frozen.speculate_params(params)
        assert frozen.commit_speculation(1.0)
        reference.step()
        assert _same(_snapshot(frozen), _snapshot(reference))
    frozen.thaw_hyperparameters()
    _scheduler_moves_on(reference)
    for host in (frozen, reference):
        _grads(_all_params(host), 2)
        host.step()
    assert _same(_snapshot(frozen), _snapshot(reference))


def test_freezing_needs_the_cpp_step() -> None:
    host = HostOptimizer(FACTORIES["sgd"](_params(0)), OptimizerOffload(), announce=False)
    with pytest.raises(RuntimeError, match="C\\+\\+ steps only"):
        host.freeze_hyperparameters()


@pytest.mark.parametrize("name", ["adamw", "adam", "adam-groups"])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_gpu_share_matches_torch(name: str, share: float) -> None:
    """gpu_share: that share of each tensor's elements steps through StreamedAdam (here on the
    CPU device: the same chunked code with plain copies, 7-element chunks so that tensors span
    several), the rest on the C++ step; in place, speculated and committed, with a grad scale,
    and with bf16 gradients. Equal to torch's step up to fp32 rounding."""
    from slipstream.offload.gpu_stream import StreamedAdam

    reference = _params(0)
    offloaded = [torch.nn.Parameter(p.detach().clone()) for p in reference]
    ref_opt = FACTORIES[name](reference)
    landed: dict[int, torch.Tensor] = {}  # the gradients, as offload hands them over
    host = HostOptimizer(
        FACTORIES[name](offloaded),
        OptimizerOffload(gpu_share=share),
        announce=False,
        device=torch.device("cpu"),
        grad_of=lambda p: landed.get(id(p)),
    )
    assert host.gpu_share == share and isinstance(host._streamed, StreamedAdam)
    host._streamed.chunk_numel = 7
    for step in range(4):
        _grads(reference, step)
        _grads(offloaded, step)
        scale = 0.5 if step == 2 else 1.0
        for p in reference:
            if step == 3:  # bf16 gradients, widened exactly as they are read
                p.grad = p.grad.bfloat16().float()
            p.grad.mul_(scale)
        for p in offloaded:
            landed[id(p)] = p.grad.bfloat16() if step == 3 else p.grad
        ref_opt.step()
        if step in (1, 2):
            host.speculate_params(offloaded, scale)
            assert host.commit_speculation(scale)
        else:
            host.step(grad_scale=scale)
        for r, o in zip(reference, offloaded):
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    for r, o in zip(reference, offloaded):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                host.optimizer.state[o][key], ref_opt.state[r][key], rtol=1e-6, atol=1e-6
            )


def test_gpu_share_is_checked_and_needs_adam() -> None:
    with pytest.raises(ValueError, match="gpu_share"):
        OptimizerOffload(gpu_share=1.5)
    with pytest.raises(ValueError, match="gpu_share"):
        OptimizerOffload(device="nvme", nvme_path="/tmp", gpu_share=0.5)
    host = HostOptimizer(
        FACTORIES["lion"](_params(0)),
        OptimizerOffload(gpu_share=0.5),
        announce=False,
        device=torch.device("cpu"),
    )
    assert host.gpu_share == 0.0 and host._streamed is None  # Lion: the CPU steps it all


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("pinned", [True, False])
def test_gpu_share_on_a_gpu_matches_torch(pinned: bool) -> None:
    """The streamed share on a GPU (chunks of 7 elements, three in flight on three streams),
    in place and speculated, pinned or pageable host tensors: torch's step to fp32 rounding."""
    reference = _params(0)
    offloaded = [
        torch.nn.Parameter(p.detach().clone().pin_memory() if pinned else p.detach().clone())
        for p in reference
    ]
    ref_opt = FACTORIES["adamw"](reference)
    host = HostOptimizer(
        FACTORIES["adamw"](offloaded),
        OptimizerOffload(gpu_share=0.5),
        announce=False,
        device=torch.device("cuda"),
        allocate=(lambda shape: torch.empty(shape).pin_memory()) if pinned else None,
    )
    assert host._streamed is not None and host._streamed.cuda
    host._streamed.chunk_numel = 7
    for step in range(3):
        _grads(reference, step)
        _grads(offloaded, step)
        ref_opt.step()
        if step == 1:
            host.speculate_params(offloaded)
            assert host.commit_speculation()
        else:
            host.step()
        for r, o in zip(reference, offloaded):
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
