"""AutoTP training (``tensor_parallel.autotp_size``) equals single-process PyTorch step by step.

A tiny random Llama is trained by ``slipstream.initialize`` at TP=2 (2 ranks, stage 0 with
gradient clipping that bites) and TP=2 x DP=2 (4 ranks, ZeRO-1, clipping too), beside the unsharded model
trained by plain PyTorch on the whole global batch; losses and every parameter shard must match
(fp32, 1e-5 relative). In the 4-rank world an fp16 run (ZeRO-2, with and without CPU
offload) with an inf on one rank's gradient skips that step on every rank alike, and so does
a PP=2 x TP=2 fp16 pipeline (stage 0 and ZeRO-1) against plain PyTorch under the same autocast
and loss scale (2e-3 relative). Bad configurations raise errors that name the problem.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("transformers")

RTOL = 1e-5
FP16_RTOL = 2e-3
LR = 0.5


def _tiny_llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "attn_implementation": "eager",
    }
    settings.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings))


def _global_batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(100 + step))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _train_autotp(
    tp: int, stage: int, clip: float, steps: int = 3, export_dir: str | None = None
) -> dict[str, float]:
    """Train with AutoTP beside the unsharded reference; return the worst relative errors."""
    import torch.distributed as dist

    import slipstream

    micro = 2
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        # SGD with momentum: linear in the gradients, so fp32 reduction-order differences stay
        # at their own size (Adam's m/sqrt(v) turns them into sign flips of near-zero entries).
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "tensor_parallel": {"autotp_size": tp},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    dp = engine.dp_world_size
    assert dp == dist.get_world_size() // tp
    dp_rank = dist.get_rank(engine.dp_group) if engine.dp_group is not None else 0
    tp_rank = dist.get_rank() % tp  # AutoTP's tensor-parallel ranks are adjacent
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)

    worst = {"loss": 0.0, "param": 0.0, "norm": 0.0}
    for step in range(steps):
        batch = _global_batch(step, micro * dp)
        mine = batch[dp_rank * micro : (dp_rank + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        ref_loss = reference(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), clip if clip > 0 else float("inf")
        )
        if step == 0 and clip > 0:
            assert float(ref_norm) > 2 * clip, "the clip must change the step to test it"
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        if engine.dp_group is not None:
            dist.all_reduce(mean_loss, group=engine.dp_group)
        worst["loss"] = max(worst["loss"], _rel(mean_loss / dp, ref_loss.detach()))
        worst["norm"] = max(worst["norm"], _rel(engine._last_grad_norm, ref_norm))

    ref_params = dict(reference.named_parameters())
    for name, param in engine.module.named_parameters():
        expected = ref_params[name].detach()
        dim = getattr(param, "tp_partition_dim", None)
        if dim is not None:
            assert param.tp_size == tp and param.tp_rank == tp_rank, name
            expected = expected.chunk(tp, dim=dim)[tp_rank]
        worst["param"] = max(worst["param"], _rel(param.detach(), expected))
    sharded = [n for n, p in engine.module.named_parameters() if hasattr(p, "tp_partition_dim")]
    assert "model.layers.0.self_attn.q_proj.weight" in sharded
    assert "model.embed_tokens.weight" in sharded and "lm_head.weight" in sharded
    assert "model.norm.weight" not in sharded
    if export_dir is not None:
        # save_16bit_model gathers the shards: the file holds the unsplit trained model.
        from safetensors.torch import load_file

        assert engine.save_16bit_model(export_dir)
        saved = load_file(f"{export_dir}/model.safetensors")
        for name, value in reference.state_dict().items():
            worst["export"] = max(worst.get("export", 0.0), _rel(saved[name], value))
    return worst


def _check_bad_configs() -> None:
    import slipstream
    from slipstream.config import ConfigError

    base = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    with pytest.raises(ConfigError, match=r"autotp_size = 3 does not divide the world size 2"):
        slipstream.initialize(
            model=_tiny_llama(), config={**base, "tensor_parallel": {"autotp_size": 3}}
        )
    tp2 = {**base, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ValueError, match=r"config.num_key_value_heads = 1"):
        slipstream.initialize(model=_tiny_llama(num_key_value_heads=1), config=tp2)
    with pytest.raises(ValueError, match=r"config.vocab_size = 63"):
        slipstream.initialize(model=_tiny_llama(vocab_size=63), config=tp2)
    with pytest.raises(NotImplementedError, match=r"model_type.*got None \(Linear\)"):
        slipstream.initialize(model=torch.nn.Linear(4, 4), config=tp2)
    with pytest.raises(NotImplementedError, match=r"stage = 3 with tensor parallelism"):
        slipstream.initialize(
            model=_tiny_llama(), config={**tp2, "zero_optimization": {"stage": 3}}
        )
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_sise"):
        slipstream.initialize(
            model=_tiny_llama(), config={**base, "tensor_parallel": {"autotp_sise": 2}}
        )


def _check_partitioned_activation_checkpoint() -> None:
    """partition_activations at TP=2: each rank saves half of the block's input; the
    recomputation gathers it; outputs and gradients equal the uncheckpointed block."""
    from slipstream import checkpointing
    from slipstream.comm.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        split_flat_to_tensor_parallel_region,
    )
    from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid

    grid = ProcessGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    group = grid.group("tensor")
    torch.manual_seed(3)
    block = torch.nn.Sequential(
        ColumnParallelLinear(8, 16, group=group),
        torch.nn.GELU(),
        RowParallelLinear(16, 8, group=group),
    )
    x = torch.randn(3, 5, 7, 8, generator=torch.Generator().manual_seed(4))[..., :-1, :]
    assert split_flat_to_tensor_parallel_region(x, group).numel() == x.numel() // 2
    checkpointing.configure(grid, partition_activations=True)
    try:
        grads = []
        for use_checkpoint in (True, False):
            block.zero_grad()
            inputs = x.clone().requires_grad_()
            out = checkpointing.checkpoint(block, inputs) if use_checkpoint else block(inputs)
            (out * torch.linspace(-1, 1, 8)).sum().backward()
            grads.append([out.detach(), inputs.grad, *(p.grad for p in block.parameters())])
        for got, expected in zip(*grads):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    finally:
        checkpointing.reset()


def _check_nonfinite_vote_spans_tensor_group() -> None:
    """ZeRO-1 at TP=2: a NaN in one TP rank's gradient shard skips the step on both ranks."""
    import torch.distributed as dist

    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = slipstream.initialize(model=_tiny_llama(), config=config)
    weight = engine.module.model.layers[0].self_attn.q_proj.weight
    if dist.get_rank() == 1:
        weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    before = weight.detach().clone()
    ids = _global_batch(0, 1)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert engine.nonfinite_skipped_steps == 1
    assert torch.equal(weight.detach(), before)


def _train_fp16_overflow_on_one_rank(
    offload: bool = False, steps: int = 3, bad: int = 1
) -> dict[str, float]:
    """TP=2 x DP=2, ZeRO-2, fp16 (dynamic scale): only global rank 3 sees an inf gradient at
    step ``bad``. Every rank must skip that step and halve its scale, and the run must equal,
    bit for bit, the same run fed the other steps' batches only (its scale halved by hand
    where the skip was). ``offload``: the masters and the step on the CPU (the offloaded
    step's own vote). Returns the largest differences (0.0 when all is well)."""
    import torch.distributed as dist

    import slipstream

    micro = 2
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {
            "stage": 2,
            **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
        },
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    runs = []
    for inject in (True, False):
        engine, *_ = slipstream.initialize(model=_tiny_llama(), config=config)
        dp_rank = dist.get_rank(engine.dp_group)
        weight = engine.module.model.layers[0].self_attn.q_proj.weight
        poison = {"on": False}
        if dist.get_rank() == 3:
            weight.register_hook(
                lambda g, flag=poison: torch.full_like(g, float("inf")) if flag["on"] else g
            )
        scales, losses = [], []
        start = [p.detach().clone() for p in engine.module.parameters()]
        for step in range(steps):
            if step == bad and not inject:
                engine.loss_scaler.update(True)  # what the skipped step does to the scale
                continue
            poison["on"] = inject and step == bad
            before = [p.detach().clone() for p in engine.module.parameters()]
            batch = _global_batch(step, micro * 2)[dp_rank * micro : (dp_rank + 1) * micro]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            scales.append(float(engine.cur_scale))
            losses.append(float(loss.detach()))
            if step == bad:  # skipped: no parameter moved, on any rank
                moved = [not torch.equal(a, p) for a, p in zip(before, engine.module.parameters())]
                assert not any(moved), f"rank {dist.get_rank()} stepped on the overflow"
        assert any(not torch.equal(a, p) for a, p in zip(start, engine.module.parameters()))
        runs.append((engine, scales, losses))
    (poisoned, scales, losses), (clean, _, clean_losses) = runs
    assert poisoned.skipped_steps == 1 and clean.skipped_steps == 0
    assert scales == [256.0, 128.0, 128.0], scales
    everyone = torch.tensor(scales)
    gathered = [torch.zeros_like(everyone) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, everyone)
    assert all(torch.equal(g, everyone) for g in gathered), gathered
    worst = {
        "loss": max(abs(a - b) for a, b in zip(losses[:bad] + losses[bad + 1 :], clean_losses))
    }
    worst["param"] = max(
        float((a.detach().float() - b.detach().float()).abs().max())
        for a, b in zip(poisoned.module.parameters(), clean.module.parameters())
    )
    return worst


class _SequenceParallelModel(torch.nn.Module):
    """norm -> column -> GELU -> row with sequence parallelism; ``group=None``: unsplit."""

    def __init__(self, group: Any) -> None:
        from slipstream.comm.tensor_parallel import (
            ColumnParallelLinear,
            RowParallelLinear,
            mark_sequence_parallel,
        )

        super().__init__()
        self.group = group
        torch.manual_seed(5)
        self.norm = torch.nn.LayerNorm(8)
        sp = group is not None
        self.up = ColumnParallelLinear(8, 16, group=group, sequence_parallel=sp)
        self.down = RowParallelLinear(16, 8, group=group, sequence_parallel=sp)
        if sp:
            for param in self.norm.parameters():
                mark_sequence_parallel(param)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from slipstream.comm.tensor_parallel import (
            gather_from_tensor_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        x = scatter_to_sequence_parallel_region(x, self.group)
        out = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        out = gather_from_tensor_parallel_region(out, self.group, dim=1)
        return torch.nn.functional.mse_loss(out, y)


def _train_sequence_parallel(stage: int, steps: int = 2) -> float:
    """A user-built sequence-parallel model through initialize(mpu=grid) at TP=2."""
    import slipstream
    from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid

    grid = ProcessGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    model = _SequenceParallelModel(grid.group("tensor"))
    reference = _SequenceParallelModel(None)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.05,
    }
    engine, *_ = slipstream.initialize(model=model, config=config, mpu=grid)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(steps):
        gen = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
        engine.backward(engine(x, y))
        engine.step()
        reference(x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    worst = 0.0
    for param, ref in zip(model.parameters(), reference.parameters()):
        expected = ref.detach()
        if hasattr(param, "tp_partition_dim"):
            expected = expected.chunk(2, dim=param.tp_partition_dim)[param.tp_rank]
        worst = max(worst, _rel(param.detach(), expected))
    return worst


def _check_checkpoint_round_trip(save_dir: str) -> None:
    """AutoTP at TP=2, ZeRO-1: a checkpoint restores the shards and the next step's loss."""
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = slipstream.initialize(model=_tiny_llama(), config=config)
    ids = _global_batch(0, 1)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="tp2")
    saved = [p.detach().clone() for p in engine.module.parameters()]
    following = _global_batch(1, 1)
    expected = float(engine(input_ids=following, labels=following).loss)
    engine.backward(engine(input_ids=following, labels=following).loss)
    engine.step()  # moves the weights and Adam's moments away from the checkpoint
    engine.load_checkpoint(save_dir, tag="tp2")
    for param, before in zip(engine.module.parameters(), saved):
        assert torch.equal(param.detach(), before)
    assert float(engine(input_ids=following, labels=following).loss) == expected


def _world_of_two(export_dir: str) -> dict[str, float]:
    _check_bad_configs()
    _check_nonfinite_vote_spans_tensor_group()
    _check_checkpoint_round_trip(export_dir + "/ckpt")
    _check_partitioned_activation_checkpoint()
    # max_norm 0.5 is far below the tiny model's gradient norm: clipping changes every step.
    worst = _train_autotp(tp=2, stage=0, clip=0.5, export_dir=export_dir)
    worst["sequence_parallel_zero0"] = _train_sequence_parallel(stage=0)
    worst["sequence_parallel_zero1"] = _train_sequence_parallel(stage=1)
    return worst


def _pipeline_of_tp_layers(group: Any) -> list[torch.nn.Module]:
    """Two stages of a column -> row MLP each; with ``group=None`` the unsplit layers."""
    from slipstream.comm.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(1)
    return [
        ColumnParallelLinear(8, 16, group=group),
        torch.nn.ReLU(),
        RowParallelLinear(16, 8, group=group),
        ColumnParallelLinear(8, 16, group=group),
        torch.nn.Tanh(),
        RowParallelLinear(16, 4, group=group),
    ]


def _train_pp2_tp2(
    steps: int = 3, clip: float = 0.3, fp16_stage: int | None = None, offload: bool = False
) -> dict[str, float]:
    """PP=2 x TP=2: a PipelineModule whose stages are built from TP layers, vs plain PyTorch,
    with gradient clipping that bites (the norm spans the stages and the tensor group).

    ``fp16_stage``: fp16 (autocast, dynamic loss scale 2^8, hysteresis 1) at that ZeRO stage,
    against plain PyTorch under the same autocast and loss scale. At step 1 only global rank
    3 (last stage, tensor rank 1) sees an inf, in a replicated weight (a row-parallel bias,
    whose squares the norm counts on one tensor rank only): every rank must skip that step,
    as the reference does, and halve the scale; the other steps match within fp16's rounding
    (the tensor split sums in another order). ``offload``: the masters and the step on the
    CPU (the offloaded step takes the pipeline's squares too)."""
    import torch.distributed as dist

    import slipstream
    from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid
    from slipstream.pipeline import PipelineModule

    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    grid = ProcessGrid(topology)  # the layers need the tensor group before the module exists
    tp_rank = grid.get_model_parallel_rank()
    layers = _pipeline_of_tp_layers(grid.group("tensor"))
    reference = torch.nn.Sequential(*_pipeline_of_tp_layers(None))
    module = PipelineModule(layers, topology=topology, loss_fn=torch.nn.functional.mse_loss)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": clip,
    }
    scale, bad = 1.0, -1
    if fp16_stage is not None:
        scale, bad = 2.0**8, 1
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        config["zero_optimization"] = {
            "stage": fp16_stage,
            **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
        }
    engine, *_ = slipstream.initialize(model=module, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    worst = {"loss": 0.0, "param": 0.0, "grad_norm": 0.0}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        batches = [
            (torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(2)
        ]
        before = [p.detach().clone() for p in engine.module.parameters()]
        handle = None
        if step == bad and dist.get_rank() == 3:  # a replicated weight: only rank 3 sees it
            handle = layers[5].bias.register_hook(lambda g: g * float("inf"))
        loss = engine.train_batch(iter(batches))
        if handle is not None:
            handle.remove()
        if fp16_stage is None:
            ref_loss = sum(torch.nn.functional.mse_loss(reference(x), y) / 2 for x, y in batches)
            ref_loss.backward()
        else:
            ref_loss = torch.zeros(())
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.float16):
                    part = torch.nn.functional.mse_loss(reference(x), y) / 2
                (part * scale).backward()
                ref_loss = ref_loss + part.detach().float()
        if step == bad:  # skipped on every rank, and by the reference
            optimizer.zero_grad()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
            worst["bad_step_moved"] = 0.0 if unchanged else 1.0
            worst["not_skipped"] = abs(engine.skipped_steps - 1)
            worst["scale_kept"] = abs(engine.loss_scaler.loss_scale - scale / 2)
            scale /= 2
            continue
        if scale != 1.0:
            for param in reference.parameters():
                param.grad.div_(scale)  # type: ignore[union-attr]
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        assert float(ref_norm) > 2 * clip, float(ref_norm)  # the clipping bites
        optimizer.step()
        optimizer.zero_grad()
        norm = torch.tensor(engine.get_global_grad_norm())
        worst["grad_norm"] = max(worst["grad_norm"], _rel(norm, ref_norm.detach()))
        if engine.is_last_stage():
            worst["loss"] = max(worst["loss"], _rel(loss.detach().float(), ref_loss.detach()))
    ref_layers = list(reference)
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param.device.type == "meta" or not _owned(engine.module, param):
                continue
            expected = getattr(ref_layers[index], name).detach()
            dim = getattr(param, "tp_partition_dim", None)
            if dim is not None:
                expected = expected.chunk(2, dim=dim)[tp_rank]
            worst["param"] = max(worst["param"], _rel(param.detach(), expected))
    assert dist.get_world_size() == 4
    return worst


def _pp_tp_engine(tp: int, dp: int, stage: int, pp: int = 2) -> Any:
    """A PP=``pp`` x TP=``tp`` x DP=``dp`` engine of ``_pipeline_of_tp_layers``, its weights noise
    (only a checkpoint can make them right), AdamW with clipping."""
    import slipstream
    from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid
    from slipstream.pipeline import PipelineModule

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    grid = ProcessGrid(topology)
    layers = _pipeline_of_tp_layers(grid.group("tensor") if tp > 1 else None)
    module = PipelineModule(layers, topology=topology, loss_fn=torch.nn.functional.mse_loss)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2 // dp,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    return engine


def _pp_tp_step(engine: Any, step: int) -> float:
    """One step on the global batch of two micro-batches (a replica's share at DP=2)."""
    gen = torch.Generator().manual_seed(100 + step)
    batches = [(torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in "ab"]
    grid = engine.grid
    if grid.data_parallel_size > 1:
        batches = batches[grid.data_parallel_id :: grid.data_parallel_size]
    return float(engine.train_batch(iter(batches)))


def _check_pp2_tp2_checkpoint(root: str) -> dict[str, float]:
    """Saved at PP=2 x TP=2 (stage 0) after 2 steps; resumed at PP=2 x TP=2 and at
    PP=2 x TP=1 x DP=2 (ZeRO-1), which saves after step 3 for PP=2 x TP=2 to resume (pieces
    assembled on load, then an unsplit checkpoint split), and at PP=1 x TP=2 x DP=2 (ZeRO-2):
    the losses equal the uninterrupted run's; `slipstream convert` of the PP=2 x TP=2 checkpoint gives the unsplit weights."""
    import torch.distributed as dist

    torch.manual_seed(3)
    engine = _pp_tp_engine(tp=2, dp=1, stage=0)
    for step in range(2):
        _pp_tp_step(engine, step)
    engine.save_checkpoint(root, tag="t")
    expected = [_pp_tp_step(engine, step) for step in (2, 3)]
    worst: dict[str, float] = {}
    layouts = (("same_layout_zero1", 2, 1, 1, 2), ("tp1_dp2_zero1", 1, 2, 1, 2))
    for name, tp, dp, stage, pp in (*layouts, ("pp1_tp2_dp2_zero2", 2, 2, 2, 1)):
        resumed = _pp_tp_engine(tp=tp, dp=dp, stage=stage, pp=pp)
        resumed.load_checkpoint(root, tag="t")
        if tp == 1:  # `slipstream convert` assembles the pieces into the unsplit weights
            from safetensors.torch import load_file

            from slipstream.runtime.model_export import convert_to_hf_safetensors

            if dist.get_rank() == 0:
                convert_to_hf_safetensors(root, f"{root}/hf", tag="t", progress=False)
            dist.barrier()
            converted = load_file(f"{root}/hf/model.safetensors")
            worst["convert"] = max(
                _rel(param.detach(), converted[name])
                for name, param in resumed.module.named_parameters()
            )
        losses = [_pp_tp_step(resumed, 2)]
        if tp == 1:  # saved unsplit after step 3: resumed split at TP=2 for step 4
            resumed.save_checkpoint(root, tag="u")
            resumed = _pp_tp_engine(tp=2, dp=1, stage=0)
            resumed.load_checkpoint(root, tag="u")
        losses.append(_pp_tp_step(resumed, 3))
        worst[f"ckpt_{name}"] = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    return worst


def _owned(module: torch.nn.Module, param: torch.Tensor) -> bool:
    return any(param is p for p in module.parameters())


def _world_of_four(root: str) -> dict[str, Any]:
    return {
        "tp2_dp2_zero1": _train_autotp(tp=2, stage=1, clip=0.5),
        "pp2_tp2": _train_pp2_tp2(),
        "pp2_tp2_checkpoint": _check_pp2_tp2_checkpoint(root),
        "pp2_tp2_fp16_zero0": _train_pp2_tp2(steps=4, fp16_stage=0),
        "pp2_tp2_fp16_zero1": _train_pp2_tp2(steps=4, fp16_stage=1),
        "pp2_tp2_fp16_zero1_offload": _train_pp2_tp2(steps=4, fp16_stage=1, offload=True),
        "fp16_overflow_on_one_rank": _train_fp16_overflow_on_one_rank(),
        "fp16_overflow_on_one_rank_offload": _train_fp16_overflow_on_one_rank(offload=True),
    }


def test_autotp_tp2_equals_single_process(tmp_path: Any) -> None:
    for worst in run_distributed(_world_of_two, 2, str(tmp_path)):
        assert max(worst.values()) <= RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:4]


def test_autotp_tp2_dp2_and_pp2_tp2_equal_single_process(tmp_path: Any) -> None:
    for results in run_distributed(_world_of_four, 4, str(tmp_path), timeout=300):
        for name, worst in results.items():
            # fp16: the tensor split sums in another order than the unsplit reference, so the
            # two differ by fp16 roundings (measured 1.7e-4); a missed skip is off by > 0.07.
            tolerance = FP16_RTOL if "fp16" in name else RTOL
            assert max(worst.values()) <= tolerance, (name, worst)
