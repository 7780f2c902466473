"""PipelineEngine: config in, train_batch/eval_batch out, against plain PyTorch training."""

from __future__ import annotations

import pytest
import torch

from slipstream.comm.testing import run_distributed
from slipstream.kernels.config_schema import ConfigError, NotImplementedFeatureError

VOCAB, HIDDEN, LAYERS = 32, 16, 4


def _specs():
    from slipstream.pipeline.models import decoder_layer_specs

    return decoder_layer_specs(VOCAB, HIDDEN, LAYERS, 2, 24, tie_embeddings=True)


def _config(**extra):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 2, "warmup_min_lr": 0.0, "warmup_max_lr": 0.01},
        },
        "steps_per_print": 1,
    }
    config.update(extra)
    return config


def _batches(step, count=4):
    gen = torch.Generator().manual_seed(step)
    return [
        (
            torch.randint(0, VOCAB, (2, 8), generator=gen),
            torch.randint(0, VOCAB, (2, 8), generator=gen),
        )
        for _ in range(count)
    ]


def _reference_run(steps, replicas=1):
    """The same model, optimizer, schedule and clipping in plain PyTorch, on the data of
    every data-parallel replica (replica r reads _batches(100 * r + step))."""
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import language_model_loss
    from slipstream.runtime.lr_schedules import WarmupLR

    model = PipelineModule(_specs(), num_stages=1, seed_layers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    # The schedule's own class, stepped after every optimizer step as the engine must.
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=2)
    losses, lrs = [], []
    for step in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        total = 0.0
        for replica in range(replicas):
            for x, y in _batches(100 * replica + step):
                part = language_model_loss(model(x), y) / (4 * replicas)
                part.backward()
                total += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(total)
    return losses, lrs, model.state_dict()


def _engine(config, **kwargs):
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    module = PipelineModule(_specs(), loss_fn=language_model_loss, seed_layers=True, **kwargs)
    return initialize_pipeline(model=module, config=config)


def test_single_stage_engine_matches_plain_training(tmp_path):
    csv_monitor = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    engine, optimizer, loader, scheduler = _engine(
        _config(pipeline={"schedule": "zero_bubble", "stages": 1}, csv_monitor=csv_monitor),
        num_stages=1,
    )
    assert loader is None and scheduler is not None and optimizer is engine.optimizer
    assert engine.train_batch_size() == 8 and engine.gradient_accumulation_steps() == 4
    assert engine.is_first_stage() and engine.is_last_stage()
    expected_losses, expected_lrs, expected_state = _reference_run(3)
    losses, lrs = [], []
    for step in range(3):
        assert engine.get_lr() == [pytest.approx(expected_lrs[step])]
        loss = engine.train_batch(iter(_batches(step)))
        assert loss.item() == pytest.approx(expected_losses[step], rel=1e-6)
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    # DeepSpeed's pipeline events: the batch's mean loss and the lr after each step.
    for name, values in (("train_loss", losses), ("lr", lrs)):
        lines = (tmp_path / "job" / f"Train_Samples_{name}.csv").read_text().splitlines()
        assert lines == [f"step,{name}"] + [f"{8 * (i + 1)},{v}" for i, v in enumerate(values)]
    assert engine.global_steps == 3 and engine.global_samples == 24
    assert engine.get_global_grad_norm() is not None
    state = engine.module.state_dict()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    loss, logits = engine.eval_batch(iter(_batches(7)), return_logits=True)
    assert len(logits) == 4 and logits[0].shape == (2, 8, VOCAB)
    assert engine.eval_batch(iter(_batches(7))).item() == pytest.approx(loss.item())
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(torch.zeros(1))
    # A single-process save and load (layout changes: test_pipeline_checkpoint.py).
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    path = engine.save_checkpoint(tmp_path)
    engine.train_batch(iter(_batches(8)))
    assert engine.load_checkpoint(tmp_path)[0] == path and engine.global_steps == 3
    for name, param in engine.module.named_parameters():
        assert torch.equal(param, saved[name]), name


@pytest.mark.parametrize("stage", [1, 2])
def test_single_stage_engine_with_zero_matches_plain_training(stage):
    # One process: a data-parallel group of one, so the shard is the whole tensor; the
    # sharded step (reduce-scatter, norm, clip, step, all-gather) must still train the same.
    engine, optimizer, _, _ = _engine(
        _config(zero_optimization={"stage": stage}, pipeline={"schedule": "zero_bubble"}),
        num_stages=1,
    )
    assert engine.zero is not None and engine.zero.settings.stage == stage
    masters = {id(m) for m in engine.zero.masters.masters}
    assert all(id(p) in masters for group in optimizer.param_groups for p in group["params"])
    expected_losses, _, expected_state = _reference_run(3)
    for step in range(3):
        loss = engine.train_batch(iter(_batches(step)))
        assert loss.item() == pytest.approx(expected_losses[step], rel=1e-6)
        assert all(p.grad is None for p in engine.module.parameters())
    state = engine.module.state_dict()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_engine_reads_training_data_and_activation_checkpointing():
    import slipstream.checkpointing as checkpointing

    dataset = [(x[0], y[0]) for step in range(4) for x, y in _batches(step)]
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    module = PipelineModule(
        _specs(), num_stages=1, loss_fn=language_model_loss, activation_checkpoint_interval=1
    )
    config = _config(
        activation_checkpointing={"cpu_checkpointing": True},
        pipeline={"activation_checkpoint_interval": 1},
    )
    try:
        engine, _, loader, _ = initialize_pipeline(
            model=module, config=config, training_data=dataset
        )
        assert checkpointing.get_config().cpu_checkpointing
        assert loader is not None
        for _ in range(3):  # more batches than one pass of the loader holds
            assert torch.isfinite(engine.train_batch())
    finally:
        checkpointing.reset()


def test_engine_refuses_what_it_cannot_do():
    with pytest.raises(NotImplementedFeatureError, match=r"zero_optimization\.stage = 3"):
        _engine(_config(zero_optimization={"stage": 3}), num_stages=1)
    with pytest.raises(ConfigError, match=r"pipeline\.stages = 2 but the PipelineModule"):
        _engine(_config(pipeline={"stages": 2}), num_stages=1)
    with pytest.raises(ConfigError, match=r"pipeline\.seed_layers"):
        from slipstream.pipeline import PipelineModule
        from slipstream.runtime.pipeline_engine import initialize_pipeline

        initialize_pipeline(
            model=PipelineModule(_specs(), num_stages=1),
            config=_config(pipeline={"seed_layers": True}),
        )
    with pytest.raises(ValueError, match="virtual_stages"):
        _engine(_config(), num_stages=1, virtual_stages=2)  # 1F1B with two chunks
    with pytest.raises(TypeError, match="PipelineModule"):
        from slipstream.config import load_config
        from slipstream.runtime.pipeline_engine import PipelineEngine

        PipelineEngine(model=torch.nn.Linear(2, 2), config=load_config(_config(), world_size=1))


def _pipelined_engine():
    import torch.distributed as dist

    from slipstream.pipeline import PipelineModule
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    # PP=2 × DP=2: replicas read different data; the interleaved schedule needs 2 chunks.
    expected_losses, _, expected_state = _reference_run(2, replicas=2)
    engine, _, _, _ = _engine(
        _config(pipeline={"schedule": "interleaved_1f1b"}), num_stages=2, virtual_stages=2
    )
    replica = engine.grid.data_parallel_id
    assert engine.train_batch_size() == 16
    losses = [engine.train_batch(iter(_batches(100 * replica + step))).item() for step in range(2)]
    state = engine.module.state_dict()
    worst = max((state[k] - expected_state[k]).abs().max().item() for k in state)

    # Unseeded modules differ per rank: the engine must start the replicas from one copy.
    torch.manual_seed(1000 + dist.get_rank())
    other, _, _, _ = initialize_pipeline(
        model=PipelineModule(_specs(), num_stages=2), config=_config()
    )
    flat = torch.cat([p.detach().reshape(-1) for p in other.module.parameters()])
    summed = flat.clone()
    dist.all_reduce(summed, group=other.grid.get_data_parallel_group())
    replicas_equal = torch.equal(summed, 2 * flat)
    return losses, expected_losses, worst, sorted(state), replicas_equal


@pytest.mark.slow
def test_pipelined_engine_matches_plain_training():
    results = run_distributed(_pipelined_engine, 4, timeout=240)
    keys = set()
    for losses, expected, worst, names, replicas_equal in results:
        assert losses == pytest.approx(expected, rel=1e-5)
        assert worst < 1e-5
        assert replicas_equal
        keys.update(names)
    assert all(r[0] == results[0][0] for r in results)  # one loss, reported on every rank
    assert "tied_modules.embed.weight" in keys and f"{LAYERS + 1}.weight" in keys  # final norm


def test_umbrella_re_exports():
    import slipstream.checkpointing as checkpointing
    import slipstream.pipe as pipe
    from slipstream.pipeline import module, rng

    assert pipe.PipelineModule is module.PipelineModule
    assert pipe.LayerSpec is module.LayerSpec and pipe.TiedLayerSpec is module.TiedLayerSpec
    assert checkpointing.get_cuda_rng_tracker() is rng.get_rng_tracker()
    assert callable(checkpointing.model_parallel_cuda_manual_seed)


def _state_matches(got, expected, **tolerance):
    """Two ``ReplicatedGradientPath.state_dict()``s: same layout (masters by position, the
    torch optimizer's state by index, same keys and groups) and values within ``tolerance``."""
    assert sorted(got) == sorted(expected) == ["masters", "optimizer"]
    assert [m.shape for m in got["masters"]] == [m.shape for m in expected["masters"]]
    for a, b in zip(got["masters"], expected["masters"]):
        torch.testing.assert_close(a, b, **tolerance)
    state, ref = got["optimizer"]["state"], expected["optimizer"]["state"]
    assert sorted(state) == sorted(ref) == list(range(len(got["masters"])))
    for index, entry in state.items():
        assert sorted(entry) == sorted(ref[index])
        for key, value in entry.items():
            torch.testing.assert_close(value, ref[index][key], **tolerance)

    # (A checkpoint's groups come back from JSON: betas as a list.)
    def plain(groups):
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]

    assert plain(got["optimizer"]["param_groups"]) == plain(expected["optimizer"]["param_groups"])


def test_pipeline_stage0_is_the_plain_engines_replicated_path(tmp_path):
    """The pipeline engine's stage 0 is slipstream.zero's ReplicatedGradientPath, driven as
    the plain engine drives it: the same state_dict layout and values after the same training
    (clipping that bites), every step through the path's step(), and states that move between
    the two engines and through a pipeline checkpoint."""
    import torch.distributed as dist

    initialized = dist.is_initialized()
    try:
        _check_stage0_path(tmp_path)
    finally:  # the plain engine starts a one-process group: leave none behind for other tests
        if not initialized and dist.is_initialized():
            dist.destroy_process_group()


def _check_stage0_path(tmp_path):
    import copy

    import slipstream
    from slipstream.pipeline import PipelineModule
    from slipstream.runtime.checkpoint_manager import gradient_path_state
    from slipstream.runtime.pipeline_engine import initialize_pipeline
    from slipstream.zero import ReplicatedGradientPath

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]
    plain_model = torch.nn.Sequential(*copy.deepcopy(layers))
    config = _config(gradient_clipping=0.05, gradient_accumulation_steps=2)
    pipe, *_ = initialize_pipeline(
        model=PipelineModule(layers, num_stages=1, loss_fn=torch.nn.functional.mse_loss),
        config=config,
    )
    plain, *_ = slipstream.initialize(model=plain_model, config=config)
    path = pipe.gradient_path
    assert type(path) is ReplicatedGradientPath and path.masters is None
    assert gradient_path_state(pipe).path is path and pipe.zero is None
    steps = []
    original_step = path.step
    path.step = lambda **kwargs: steps.append(kwargs) or original_step(**kwargs)

    def batches(step):
        gen = torch.Generator().manual_seed(step)
        return [(torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in "ab"]

    def train_plain(step):
        for x, y in batches(step):
            plain.backward(torch.nn.functional.mse_loss(plain(x), y))
            plain.step()

    for step in range(3):
        pipe.train_batch(iter(batches(step)))
        train_plain(step)
    assert len(steps) == 3 and all(s["grad_squares"] is not None for s in steps)
    assert float(plain.get_global_grad_norm()) > 0.1  # the clipping bites
    # The norm is summed differently (squares vs torch's norm of norms): 1e-6.
    _state_matches(path.state_dict(), plain.gradient_path.state_dict(), rtol=1e-6, atol=1e-7)
    assert sorted(path.memory_report()) == sorted(plain.gradient_path.memory_report())
    # The plain engine's state loads into the pipeline's path: the next step is the same.
    # (A copy: the state holds the plain engine's own tensors, which torch's
    # Optimizer.load_state_dict would adopt as they are.)
    path.load_state_dict(copy.deepcopy(plain.gradient_path.state_dict()))
    pipe.train_batch(iter(batches(3)))
    train_plain(3)
    _state_matches(path.state_dict(), plain.gradient_path.state_dict(), rtol=1e-6, atol=1e-7)
    # A pipeline checkpoint round trip restores the path's state exactly.
    saved = copy.deepcopy(path.state_dict())
    pipe.save_checkpoint(tmp_path)
    pipe.train_batch(iter(batches(4)))
    pipe.load_checkpoint(tmp_path)
    _state_matches(path.state_dict(), saved, rtol=0, atol=0)
