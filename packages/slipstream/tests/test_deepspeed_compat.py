"""DeepSpeed-style scripts run against Slipstream with only the import changed.

Each script below is written the way DeepSpeed's tutorials and examples write theirs (``import
slipstream as deepspeed``, ``deepspeed.accelerator.get_accelerator``, ``deepspeed.utils``,
``deepspeed.comm as dist``, ...), and is checked against plain PyTorch where there is a number
to compare. The multi-process scripts share one spawned gloo world of two ranks.
"""

from __future__ import annotations

import copy
import logging
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from slipstream.comm.testing import run_distributed

DOC = Path(__file__).resolve().parents[3] / "docs" / "deepspeed-compat.md"
STATUSES = ("works", "differs", "raises", "absent")


def _doc_rows() -> list[tuple[str, str, str, str]]:
    """(DeepSpeed name, Slipstream name or "—", status, notes) for every row of the tables."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[2] not in STATUSES:
            continue
        deepspeed_name, slipstream_name, status, notes = cells
        rows.append((deepspeed_name.strip("`"), slipstream_name.strip("`"), status, notes))
    return rows


def _resolve(dotted: str) -> object:
    """Import the longest importable prefix of ``dotted`` and walk the rest as attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ImportError(dotted)


def _check_engine_rows(engine: object) -> int:
    """The engine rows of the table against a live engine; returns how many were checked."""
    checked = 0
    for deepspeed_name, slipstream_name, status, _ in _doc_rows():
        if not deepspeed_name.startswith("DeepSpeedEngine."):
            continue
        attribute = deepspeed_name.split(".", 1)[1]
        if status == "absent":
            assert not hasattr(engine, attribute), f"{deepspeed_name} is marked absent but exists"
        else:
            assert slipstream_name.startswith("engine."), slipstream_name
            assert hasattr(engine, slipstream_name.split(".", 1)[1]), slipstream_name
        checked += 1
    return checked


def test_the_compat_table_matches_the_code() -> None:
    from slipstream.accelerator import DeepSpeedAccelerator

    rows = _doc_rows()
    assert len(rows) > 150, "the tables of docs/deepspeed-compat.md were not found"
    for deepspeed_name, slipstream_name, status, notes in rows:
        if deepspeed_name.startswith("DeepSpeedEngine."):
            continue  # checked on a live engine in the two-rank world below
        if status == "absent":
            assert slipstream_name == "—", deepspeed_name
            assert "#" in notes or "not planned" in notes or "use" in notes, deepspeed_name
            if deepspeed_name.startswith("deepspeed."):
                with pytest.raises((ImportError, AttributeError)):
                    _resolve("slipstream." + deepspeed_name.split(".", 1)[1])
            continue
        if slipstream_name.startswith("get_accelerator()."):
            assert hasattr(DeepSpeedAccelerator, slipstream_name.split(".", 1)[1]), deepspeed_name
            continue
        assert _resolve(slipstream_name) is not None, deepspeed_name
        if status == "works" and deepspeed_name.startswith("deepspeed."):
            # Same name, same place: only the package name changes.
            assert slipstream_name == "slipstream." + deepspeed_name.split(".", 1)[1], (
                f"{deepspeed_name} is marked 'works' but lives at {slipstream_name}; "
                "mark it 'differs' and say how"
            )


# --------------------------------------------------------------------------- one process


def test_accelerator_has_deepspeeds_meanings() -> None:
    from slipstream.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator.is_available()
    # Scripts build devices from these strings: torch.device(device_name(local_rank)).
    assert accelerator.device_name() == "cpu"
    assert accelerator.device_name(1) == "cpu:1"
    assert torch.device(accelerator.device_name(0)).type == "cpu"
    assert accelerator.current_device_name() == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.is_synchronized_device()
    assert torch.float32 in accelerator.supported_dtypes()
    state = accelerator.get_rng_state()
    first = torch.rand(3)
    accelerator.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert accelerator.on_accelerator(torch.ones(1))
    with pytest.raises(NotImplementedError, match=r"slipstream\.kernels\.get_op"):
        accelerator.create_op_builder("FusedAdamBuilder")
    import slipstream

    assert slipstream.accelerator.get_accelerator() is accelerator


def test_utils_and_runtime_helpers(caplog: pytest.LogCaptureFixture) -> None:
    from slipstream.runtime.utils import move_to_device, set_random_seed
    from slipstream.utils import RepeatingLoader, log_dist, logger

    numpy = pytest.importorskip("numpy")  # set_random_seed seeds NumPy when it is installed

    loader = RepeatingLoader(torch.utils.data.DataLoader(list(range(3)), batch_size=2))
    assert [next(loader).tolist() for _ in range(4)] == [[0, 1], [2], [0, 1], [2]]
    assert iter(loader) is loader

    with caplog.at_level(logging.INFO, logger="slipstream"):
        logger.info("from the shared logger")
        log_dist("no process group: every call logs", ranks=[0])
    assert "from the shared logger" in caplog.text and "every call logs" in caplog.text

    def draw() -> tuple[float, float, float]:
        return random.random(), float(numpy.random.rand()), float(torch.rand(()))

    set_random_seed(123)
    first = draw()
    set_random_seed(123)
    assert draw() == first
    set_random_seed(2**70 + 5)  # pytest-randomly style seeds are folded, not refused

    moved = move_to_device({"a": [torch.ones(1)], "b": 3}, "cpu")
    assert moved["b"] == 3 and moved["a"][0].device.type == "cpu"


def test_absent_names_say_what_to_use() -> None:
    import slipstream.utils

    with pytest.raises(AttributeError, match=r"deepspeed\.utils\.OnDevice.*slipstream\.zero\.Init"):
        _ = slipstream.utils.OnDevice
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = slipstream.utils.nope


def test_zero_init_takes_deepspeeds_arguments_and_keeps_signatures() -> None:
    import inspect

    import slipstream as deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config=config, mem_efficient_linear=False):
        # skip_init reads the class's __init__ signature for a `device` argument.
        assert "device" in inspect.signature(nn.Linear).parameters
        skipped = torch.nn.utils.skip_init(nn.Linear, 4, 3)
        built = nn.Linear(4, 3)
    assert skipped.weight.shape == (3, 4)  # materialised whole; the engine shards it later
    assert deepspeed.zero.sharded_state_of(built.weight) is not None
    with pytest.raises(TypeError, match="both config= and config_dict_or_path="):
        deepspeed.zero.Init(config=config, config_dict_or_path=config)


def test_gathered_copies_survive_the_block() -> None:
    import slipstream as deepspeed

    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    expected = layer.weight.detach().clone()
    deepspeed.zero.shard_parameters(
        layer, deepspeed.zero.ZeroSettings(stage=3, param_persistence_numel=0)
    )
    with deepspeed.zero.GatheredParameters(layer.weight):
        on_host = layer.weight.detach().cpu()  # shares storage on a CPU device
        cloned = layer.weight.clone()
    assert torch.equal(on_host, expected) and torch.equal(cloned, expected)
    assert layer.weight.untyped_storage().nbytes() == 0  # the parameter itself is released


def test_ops_optimizers_take_deepspeeds_arguments() -> None:
    from slipstream.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from slipstream.ops.lamb import FusedLamb
    from slipstream.ops.lion import DeepSpeedCPULion, FusedLion

    torch.manual_seed(0)
    start = torch.randn(64)
    grads = [torch.randn(64) for _ in range(3)]
    reference = torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1)
    for cls, kwargs in ((DeepSpeedCPUAdam, {"adamw_mode": True}), (FusedAdam, {})):
        param = torch.nn.Parameter(start.clone())
        optimizer = cls([param], lr=0.01, weight_decay=0.1, **kwargs)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        if cls is DeepSpeedCPUAdam:
            for grad in grads:
                reference.grad = grad.clone()
                torch_adamw.step()
        torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    with pytest.raises(NotImplementedError, match="gradient_clipping"):
        FusedLamb([torch.nn.Parameter(torch.ones(2))], max_grad_norm=1.0)
    for cls in (FusedLion, DeepSpeedCPULion, FusedLamb):
        param = torch.nn.Parameter(torch.ones(4))
        param.grad = torch.ones(4)
        cls([param], lr=0.1).step()
        assert torch.all(param < 1.0), cls


def test_comm_has_deepspeeds_names() -> None:
    from slipstream import comm as dist

    for name in (
        "init_distributed get_rank get_world_size get_local_rank barrier all_reduce broadcast "
        "all_gather all_gather_into_tensor reduce_scatter_tensor new_group get_global_rank "
        "ReduceOp is_initialized is_available destroy_process_group isend irecv send recv "
        "all_to_all_single get_world_group get_all_ranks_from_group inference_all_reduce"
    ).split():
        assert callable(getattr(dist, name)) or name == "ReduceOp", name
    assert dist.ReduceOp.SUM == torch.distributed.ReduceOp.SUM


# --------------------------------------------------------------------------- two ranks


class Net(nn.Module):
    """A CIFAR-tutorial-sized classifier with an attribute and a method of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.num_classes = 4

    def describe(self) -> str:
        return f"Net({self.num_classes})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 8, generator=gen), torch.randint(0, 4, (2,), generator=gen)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _cifar_style_script(stage: int, save_dir: Path) -> None:
    """A training loop as in DeepSpeed's CIFAR tutorial, checked step by step against torch."""
    import slipstream as deepspeed
    from slipstream import comm as dist
    from slipstream.accelerator import get_accelerator
    from slipstream.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
    )
    from slipstream.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 100,
        # The shipped examples pass a client optimizer *and* an optimizer block: the client's wins.
        "optimizer": {"type": "Adam", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": 1,
    }
    client = torch.optim.Adam(net.parameters(), lr=0.01)
    model_engine, optimizer, _, _ = deepspeed.initialize(
        model=net, optimizer=client, model_parameters=net.parameters(), config=ds_config
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    assert optimizer.param_groups[0]["lr"] == 0.01

    # The engine's DeepSpeed surface.
    rank = dist.get_rank()
    assert model_engine.local_rank == int(os.environ["LOCAL_RANK"])
    assert model_engine.global_rank == rank and model_engine.world_size == 2
    assert not model_engine.fp16_enabled() and not model_engine.bfloat16_enabled()
    assert model_engine.zero_optimization_stage() == stage
    assert model_engine.zero_optimization() is (stage > 0)
    assert model_engine.get_batch_info() == (4, 2, 1)
    assert model_engine.num_classes == 4 and model_engine.describe() == "Net(4)"  # fall-through
    with pytest.raises(AttributeError, match="nor its module"):
        _ = model_engine.no_such_attribute
    device = torch.device(get_accelerator().device_name(model_engine.local_rank))
    if stage == 0:
        assert _check_engine_rows(model_engine) > 40

    for step in range(3):
        inputs, labels = (t.to(device) for t in _batch(step, rank))
        loss = nn.functional.cross_entropy(model_engine(inputs), labels)
        model_engine.backward(loss)
        # The reference sees both ranks' micro-batches; the engine averages over ranks.
        ref_loss = sum(
            nn.functional.cross_entropy(reference(x), y) for x, y in map(_batch, [step] * 2, [0, 1])
        )
        (ref_loss / 2).backward()
        for (name, ref_param), param in zip(reference.named_parameters(), net.parameters()):
            grad = safe_get_full_grad(param)
            assert grad is not None
            _close(grad, ref_param.grad, f"stage {stage} step {step} grad {name}")
        model_engine.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        for (name, ref_param), param in zip(reference.named_parameters(), net.parameters()):
            _close(safe_get_full_fp32_param(param), ref_param.detach(), f"{name} after {step}")
            state = ref_optimizer.state[ref_param]
            for key in ("exp_avg", "exp_avg_sq"):
                _close(safe_get_full_optimizer_state(param, key), state[key], f"{name} {key}")
            local = safe_get_local_fp32_param(param)
            parts = [torch.empty(0)] * 2
            torch.distributed.all_gather_object(parts, local)
            whole = torch.cat(parts) if stage else local.reshape(-1)
            _close(whole, ref_param.detach().reshape(-1), f"{name} local parts")

    if stage < 3:
        # Writing a master back reaches the model's parameter too.
        new_bias = torch.full((4,), 0.25)
        safe_set_full_fp32_param(net.fc2.bias, new_bias)
        _close(safe_get_full_fp32_param(net.fc2.bias), new_bias, "set master")
        _close(net.fc2.bias.detach(), new_bias, "set parameter")
        with torch.no_grad():
            reference.fc2.bias.copy_(new_bias)
    else:
        with torch.no_grad():
            outputs = model_engine(torch.ones(1, 8))
            model_engine.empty_partition_cache()
            again = model_engine(torch.ones(1, 8))
        _close(again, outputs, "forward after empty_partition_cache")

    # Checkpoints with client state, and the zero_to_fp32 helpers.
    model_engine.save_checkpoint(save_dir, tag="final", client_state={"epoch": 3})
    _, client_state = model_engine.load_checkpoint(save_dir, tag="final")
    assert client_state["epoch"] == 3
    dist.barrier()
    fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="final")
    for name, ref_param in reference.named_parameters():
        _close(fp32[name], ref_param.detach(), f"zero_to_fp32 {name}")
    restored = load_state_dict_from_zero_checkpoint(Net(), save_dir, tag="final")
    _close(restored.fc2.weight.detach(), reference.fc2.weight.detach(), "loaded from checkpoint")
    model_engine.destroy()


def _zero_init_script() -> None:
    """zero.Init with DeepSpeed's config= alias, edited under GatheredParameters, then trained."""
    import slipstream as deepspeed

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    torch.manual_seed(1)
    reference = Net()
    torch.manual_seed(1)
    with deepspeed.zero.Init(config=ds_config, mem_efficient_linear=True):
        net = Net()
    assert net.fc1.weight.untyped_storage().nbytes() == 0  # partitioned as built
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        copies = [p.detach().cpu() for p in net.parameters()]
    for copy_, ref in zip(copies, reference.parameters()):
        _close(copy_, ref.detach(), "copy taken inside GatheredParameters")
    with deepspeed.zero.GatheredParameters(net.fc2.bias, modifier_rank=0):
        with torch.no_grad():
            net.fc2.bias.fill_(0.5)
    with torch.no_grad():
        reference.fc2.bias.fill_(0.5)
    engine, *_ = deepspeed.initialize(model=net, config=ds_config)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    _close(engine(x), reference(x), "zero.Init model forward")
    engine.destroy()


def _moe_tutorial_script() -> None:
    """The MoE tutorial: expert groups for the optimizer, from deepspeed.moe.utils."""
    import slipstream as deepspeed
    from slipstream.moe.layer import MoE
    from slipstream.moe.utils import (
        has_moe_layers,
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    class MoENet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.moe = MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=2, k=1)
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden, l_aux, _ = self.moe(self.fc(x))
            return self.head(hidden), l_aux

    torch.manual_seed(0)
    model = MoENet()
    assert has_moe_layers(model) == (True, 2)
    assert all(is_moe_param(p) for p in model.moe.experts.parameters())
    assert not any(is_moe_param(p) for p in [*model.fc.parameters(), *model.moe.gate.parameters()])
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    groups = split_params_into_different_moe_groups_for_optimizer(parameters)
    assert [g.get("moe", False) for g in groups] == [False, True]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    losses = []
    for _ in range(4):
        x, y = _batch(0, engine.global_rank)  # the same batch: the loss must go down
        logits, l_aux = engine(x)
        loss = nn.functional.cross_entropy(logits, y) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    engine.destroy()


def _pipeline_script() -> None:
    """A two-stage pipeline whose second stage starts with ReLU(inplace=True), against torch."""
    import slipstream as deepspeed
    from slipstream.pipe import PipelineModule

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Linear(8, 16), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)]

    reference = nn.Sequential(*layers())
    model = PipelineModule(
        layers(), num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform"
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters()], config=ds_config
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert engine.local_rank == int(os.environ["LOCAL_RANK"]) and engine.world_size == 2
    assert not engine.fp16_enabled() and engine.zero_optimization_stage() == 0
    assert engine.num_stages == 2  # an attribute of the PipelineModule, through the engine
    for step in range(2):
        data = [_batch(step, m) for m in range(2)]
        loss = engine.train_batch(iter(data))
        ref_loss = sum(nn.functional.cross_entropy(reference(x), y) / 2 for x, y in data)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5), (step, loss, ref_loss)


def _comm_as_dist_script() -> None:
    from slipstream import comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((2,), float(rank + 1))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    assert tensor.tolist() == [3.0, 3.0]
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    assert [t.item() for t in gathered] == [0.0, 1.0]
    group = dist.new_group([0, 1])
    assert dist.get_all_ranks_from_group(group) == [0, 1]
    assert dist.get_global_rank(group, 1) == 1
    objects = [{"from": rank}]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [{"from": 0}]
    dist.barrier()


def _deepspeed_scripts(save_dir: str) -> None:
    base = Path(save_dir)
    _comm_as_dist_script()
    for stage in (0, 2, 3):
        _cifar_style_script(stage, base / f"stage{stage}")
    _zero_init_script()
    _moe_tutorial_script()
    _pipeline_script()


def test_deepspeed_style_scripts_on_two_ranks(tmp_path: Path) -> None:
    run_distributed(_deepspeed_scripts, 2, str(tmp_path), timeout=300)
