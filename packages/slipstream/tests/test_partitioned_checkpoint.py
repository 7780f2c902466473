"""Expert- and tensor-parallel checkpoints resume at another EP size, TP size and ZeRO stage.

One spawned run on 4 gloo ranks.

- Expert parallelism: a model with a grouped-experts MoE layer (stacked weights, pieces along
  the expert dimension) and a loop-experts one (renamed to global expert ids), trained at EP=2
  ZeRO-1 (expert-DP 2) and saved after 2 of 4 steps; resumed at EP=1 ZeRO-2 (expert-DP 4) and
  at EP=4 stage 0 (expert-DP 1), which saves again for EP=2 ZeRO-2 to resume; EP=2 ZeRO-3
  resumes the first checkpoint and saves one of its own, which EP=4 ZeRO-3 and EP=1 ZeRO-2
  resume. Every resumed step's loss on every rank must equal the uninterrupted run's (fp32).
  A bf16 EP=2 ZeRO-1 checkpoint resumed by an fp32 EP=2 ZeRO-2 engine holds the fp32 masters
  in its weights (the gradient path's load_state_dict publishes them).
- Tensor parallelism: a hand-sharded TP=2 MLP (``tp_partition_dim`` 0 and 1, as
  slipstream.comm's column/row-parallel layers mark them) under ZeRO-1 over its DP=2 group is
  saved; loading at TP=1 (ZeRO-2, DP=4) and at TP=4 (stage 0) gives exactly the slices of the
  weights that were saved, Adam moments included; `slipstream convert` gives the full weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS = 4


class ExpertNet(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import FeedForwardExpert, MoE

        self.embed = nn.Linear(6, 8)
        self.grouped = MoE(
            8, FeedForwardExpert(8, 12), 4, ep_size, k=1, drop_tokens=False, use_rts=False
        )
        self.looped = MoE(
            8,
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
            4,
            ep_size,
            k=1,
            drop_tokens=False,
            use_rts=False,
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, aux, _ = self.grouped(self.embed(x))
        hidden, aux2, _ = self.looped(hidden)
        return nn.functional.cross_entropy(self.head(hidden), y) + 0.01 * (aux + aux2)


def _config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }


def _expert_engine(ep_size, stage, seed, bf16=False):
    import slipstream

    torch.manual_seed(seed)  # another start per layout: only the checkpoint aligns them
    config = {**_config(stage), "bf16": {"enabled": bf16}}
    engine, *_ = slipstream.initialize(model=ExpertNet(ep_size), config=config)
    return engine


def _weights_unlike_masters(engine) -> list[str]:
    """Stages 1-2: the parameters whose elements in this rank's shard differ from its fp32
    master shard (every part: the dense one and each expert group's)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    unlike = []
    for part in getattr(engine.zero, "parts", [engine.zero]):
        for param, master, spec in zip(part.params, part.masters.masters, part.specs):
            start, end = spec.valid_range(part.group.rank)
            mine = param.detach().reshape(-1)[start:end].float()
            if not torch.equal(mine, master.detach()[: end - start]):
                unlike.append(names[id(param)])
    return unlike


def _expert_step(engine, step):
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    loss = engine(x.to(engine.module.embed.weight.dtype), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


class TensorParallelMLP(nn.Module):
    """fc1 split by output rows (dim 0), fc2 by input columns (dim 1); ``norm`` replicated."""

    def __init__(self, full: nn.Module, tp_size: int, tp_rank: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.norm.load_state_dict(full.norm.state_dict())
        rows = 16 // tp_size
        self.fc1 = nn.Parameter(full.fc1.detach()[tp_rank * rows : (tp_rank + 1) * rows].clone())
        cols = 16 // tp_size
        self.fc2 = nn.Parameter(full.fc2.detach()[:, tp_rank * cols : (tp_rank + 1) * cols].clone())
        for param, dim in ((self.fc1, 0), (self.fc2, 1)):
            if tp_size > 1:
                param.tp_partition_dim = dim
                param.tp_size = tp_size
                param.tp_rank = tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(x) @ self.fc1.T).relu() @ self.fc2.T


class FullMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Parameter(torch.randn(16, 8))
        self.fc2 = nn.Parameter(torch.randn(8, 16))


class _Grid:
    """The smallest mpu: the data-parallel group of this rank."""

    def __init__(self, group, size):
        self.group, self.size = group, size

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self):
        return self.size

    def get_model_parallel_world_size(self):
        return 1  # activation checkpointing's view; the forward here needs no TP collectives

    def get_model_parallel_rank(self):
        return 0


def _tp_engine(tp_size, stage, groups, seed):
    import slipstream

    rank = dist.get_rank()
    torch.manual_seed(seed)
    full = FullMLP()
    with torch.no_grad():
        full.norm.weight.uniform_()
    model = TensorParallelMLP(full, tp_size, rank % tp_size)
    # Data-parallel groups: ranks of one tensor-parallel index.
    mpu = None
    if tp_size > 1:
        mpu = _Grid(groups[tp_size][rank % tp_size], dist.get_world_size() // tp_size)
    engine, *_ = slipstream.initialize(model=model, config=_config(stage), mpu=mpu)
    return engine, full


def _run(root):
    from safetensors.torch import load_file

    from slipstream.runtime.model_export import convert_to_hf_safetensors

    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # ---------------------------------------------------------------- expert parallelism
    engine = _expert_engine(2, 1, seed=1)
    out["reference"] = []
    for step in range(STEPS):
        out["reference"].append(_expert_step(engine, step))
        if step == 1:
            engine.save_checkpoint(root / "ep")
    engine = _expert_engine(1, 2, seed=2)
    engine.load_checkpoint(root / "ep")
    # convert: the unsplit model's names (global expert ids), equal to what EP=1 loaded.
    if rank == 0:
        convert_to_hf_safetensors(root / "ep", root / "ep_hf", progress=False)
    dist.barrier()
    converted = load_file(str(root / "ep_hf" / "model.safetensors"))
    plain = ExpertNet(1)
    plain.load_state_dict(converted)  # strict: every name of the unsplit model
    out["ep_convert_diff"] = max(
        (p.detach() - converted[n]).abs().max().item() for n, p in engine.module.named_parameters()
    )
    out["ep1_zero2"] = [_expert_step(engine, step) for step in (2, 3)]
    engine = _expert_engine(4, 0, seed=3)
    engine.load_checkpoint(root / "ep")
    out["ep4_zero0"] = [_expert_step(engine, 2)]
    engine.save_checkpoint(root / "ep4")
    out["ep4_zero0"].append(_expert_step(engine, 3))
    engine = _expert_engine(2, 2, seed=4)
    engine.load_checkpoint(root / "ep4")
    out["ep2_zero2"] = [_expert_step(engine, 3)]
    # ZeRO-3 with expert parallelism: EP=2 stage 3 resumes the EP=2 ZeRO-1 checkpoint, saves
    # its own after step 2, and EP=4 stage 3 and EP=1 ZeRO-2 resume that one.
    # A bf16 run's checkpoint resumed in fp32 (EP=2, ZeRO-1 -> ZeRO-2): the weights are the
    # fp32 masters, which the gradient path's load_state_dict publishes, not the bf16
    # weights of the model files.
    engine = _expert_engine(2, 1, seed=8, bf16=True)
    _expert_step(engine, 0)
    engine.save_checkpoint(root / "ep_bf16")
    engine = _expert_engine(2, 2, seed=9)
    engine.load_checkpoint(root / "ep_bf16")
    out["bf16_to_fp32_unlike"] = _weights_unlike_masters(engine)
    engine = _expert_engine(2, 3, seed=7)
    engine.load_checkpoint(root / "ep")
    out["ep2_zero3"] = [_expert_step(engine, 2)]
    engine.save_checkpoint(root / "ep_z3")
    out["ep2_zero3"].append(_expert_step(engine, 3))
    for ep, stage in ((4, 3), (1, 2)):
        engine = _expert_engine(ep, stage, seed=8 + ep)
        engine.load_checkpoint(root / "ep_z3")
        out[f"ep{ep}_zero{stage}_from_zero3"] = [_expert_step(engine, 3)]
    # ---------------------------------------------------------------- tensor parallelism
    groups = {}
    for tp in (2, 4):
        groups[tp] = {}
        for index in range(tp):
            group = dist.new_group([r for r in range(world) if r % tp == index])
            groups[tp][index] = group
    engine, _ = _tp_engine(2, 1, groups, seed=5)
    # One step on made-up gradients (the same on the replicas), for optimizer state to save.
    engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(0))).sum())
    engine.step()
    saved_rank = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.save_checkpoint(root / "tp")
    pieces = [None] * world
    dist.all_gather_object(pieces, {n: v.numpy() for n, v in saved_rank.items()})
    expected = {
        "norm.weight": torch.from_numpy(pieces[0]["norm.weight"]),
        "norm.bias": torch.from_numpy(pieces[0]["norm.bias"]),
        "fc1": torch.cat([torch.from_numpy(pieces[r]["fc1"]) for r in (0, 1)], dim=0),
        "fc2": torch.cat([torch.from_numpy(pieces[r]["fc2"]) for r in (0, 1)], dim=1),
    }
    out["tp_diff"] = {}
    moments = {}
    for tp, stage in ((1, 2), (1, 0), (4, 0)):
        engine, _ = _tp_engine(tp, stage, groups, seed=6 + tp)
        engine.load_checkpoint(root / "tp")
        worst = 0.0
        for name, param in engine.module.named_parameters():
            want = expected[name]
            if name in ("fc1", "fc2") and tp > 1:
                dim = 0 if name == "fc1" else 1
                size = want.shape[dim] // tp
                want = want.narrow(dim, (rank % tp) * size, size)
            worst = max(worst, (param.detach() - want).abs().max().item())
        out["tp_diff"][(tp, stage)] = worst
        if stage == 0:
            moments[tp] = engine.optimizer.state[engine.module.fc1]["exp_avg"].clone()
    # Adam's moments: TP=4's slice of the one saved at TP=2 is TP=1's slice of it.
    out["tp4_moment_diff"] = (
        (moments[4] - moments[1][(rank % 4) * 4 : (rank % 4 + 1) * 4]).abs().max().item()
    )
    out["tp1_moment_nonzero"] = bool(moments[1].abs().sum() > 0)
    if rank == 0:
        convert_to_hf_safetensors(root / "tp", root / "tp_hf", progress=False)
    dist.barrier()
    converted = load_file(str(root / "tp_hf" / "model.safetensors"))
    out["convert_diff"] = max((converted[n] - expected[n]).abs().max().item() for n in expected)
    return out


def test_expert_and_tensor_parallel_checkpoints_change_layout(tmp_path):
    reports = run_distributed(_run, 4, str(tmp_path), timeout=300)
    for rank, report in enumerate(reports):
        reference = report["reference"]
        for key, steps in (
            ("ep1_zero2", [2, 3]),
            ("ep4_zero0", [2, 3]),
            ("ep2_zero2", [3]),
            ("ep2_zero3", [2, 3]),
            ("ep4_zero3_from_zero3", [3]),
            ("ep1_zero2_from_zero3", [3]),
        ):
            for loss, step in zip(report[key], steps):
                assert abs(loss - reference[step]) <= 1e-6 * abs(reference[step]), (
                    rank,
                    key,
                    step,
                    loss,
                    reference[step],
                )
        assert report["ep_convert_diff"] == 0.0, rank
        assert report["bf16_to_fp32_unlike"] == [], (rank, report["bf16_to_fp32_unlike"])
        assert set(report["tp_diff"].values()) == {0.0}, (rank, report["tp_diff"])
        assert report["tp4_moment_diff"] == 0.0 and report["tp1_moment_nonzero"], rank
        assert report["convert_diff"] == 0.0, rank
