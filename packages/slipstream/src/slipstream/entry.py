"""`slipstream.initialize`: DeepSpeed's front door, returning (engine, optimizer, loader, scheduler)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from slipstream import comm
from slipstream.config import SlipstreamConfig, load_config
from slipstream.kernels.config_schema import ConfigError
from slipstream.logging_setup import setup_logging
from slipstream.runtime.engine import SlipstreamEngine

if TYPE_CHECKING:
    from slipstream.runtime.pipeline_engine import PipelineEngine

logger = logging.getLogger(__name__)

_ARG_NAMES = ("deepspeed_config", "slipstream_config", "deepscale_config")


def _config_source(args: argparse.Namespace | None, config: Any) -> Any:
    from_args = None
    if args is not None:
        for name in _ARG_NAMES:
            value = getattr(args, name, None)
            if value is not None:
                from_args = value
                break
    if from_args is not None and config is not None:
        raise ValueError(
            "a config was given twice: in the command-line arguments "
            f"(--deepspeed_config {from_args!r}) and as initialize(config=...). Pass only one."
        )
    source = config if config is not None else from_args
    if source is None:
        raise ValueError(
            "no Slipstream/DeepSpeed config: pass initialize(config=<dict or path>) or "
            "--deepspeed_config <path> (see slipstream.add_config_arguments)"
        )
    return source


def initialize(
    args: argparse.Namespace | None = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[SlipstreamEngine | PipelineEngine, torch.optim.Optimizer | None, DataLoader | None, Any]:
    """Wrap ``model`` for training as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the loader is None
    unless ``training_data`` is given, the scheduler None unless one is configured or passed.

    >>> engine, optimizer, loader, scheduler = slipstream.initialize(
    ...     model=model, model_parameters=model.parameters(), config="ds_config.json")
    """
    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is not None and config_params is not None:
        raise ValueError("pass the config as config= or config_params=, not both")
    source = _config_source(args, config if config is not None else config_params)

    if dist_init_required is None or dist_init_required:
        comm.init_distributed()
    setup_logging(comm.get_rank())

    from slipstream.pipeline.module import PipelineModule
    from slipstream.runtime.tensor_parallel import (
        apply_autotp,
        refuse_autotp_for_pipelines,
        with_data_group,
    )

    if isinstance(model, PipelineModule):
        _refuse_sequence_parallel_pipeline(source)
        refuse_autotp_for_pipelines(source)
        # A pipeline trains whole batches (train_batch/eval_batch) on its own engine, whose
        # data-parallel size comes from the module's topology.
        from slipstream.runtime.pipeline_engine import initialize_pipeline

        return initialize_pipeline(
            model=model,
            config=source,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            collate_fn=collate_fn,
        )

    # Ulysses: SP ranks share one data-parallel replica's micro-batch (the loader shards over
    # world / SP), while ZeRO and gradient averaging span the whole world (DP×SP).
    # With AutoTP too, each TP rank's share of the heads is split over SP: the grid is
    # DP × SP × TP (tensor fastest), and AutoTP's data axis (world / TP) is then DP×SP.
    sequence_grid = _sequence_parallel_grid(source, mpu, model)
    # AutoTP (tensor_parallel.autotp_size > 1): shard the model and train on the grid's DP axis.
    mpu, model_parameters = apply_autotp(model, source, mpu, optimizer, model_parameters)
    mpu = with_data_group(mpu)
    data_mpu = sequence_grid if sequence_grid is not None else mpu
    dp_world = (
        data_mpu.get_data_parallel_world_size() if data_mpu is not None else comm.get_world_size()
    )
    parsed: SlipstreamConfig = load_config(source, world_size=dp_world)
    _apply_amd_specific(parsed)
    if "comms_logger" in parsed.raw:
        comm.configure(parsed.comms_logger)  # deepspeed.initialize applies this block too
    from slipstream import checkpointing

    checkpointing.configure(mpu, deepspeed_config=parsed.activation_checkpointing)
    engine = SlipstreamEngine(
        model=model,
        config=parsed,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
    )
    # DeepSpeed's names for the sequence-parallel group and degree.
    engine.sequence_parallel_size = parsed.sequence_parallel_size
    engine.seq_parallel_group = sequence_grid.sequence_group if sequence_grid else None
    loader = None
    if training_data is not None:
        loader = _curriculum_dataloader(engine, training_data, collate_fn, data_mpu)
        if loader is None:
            loader = _build_dataloader(training_data, parsed, collate_fn, data_mpu)
    # DeepSpeed's engine.training_dataloader, and the owner slipstream.utils.safe_get_* look up.
    engine.training_dataloader = loader
    from slipstream.utils.tensor_fragment import track_engine

    track_engine(engine)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _refuse_sequence_parallel_pipeline(source: Any) -> None:
    from slipstream.config.loading import read_config_source

    size = read_config_source(source)[0].get("sequence_parallel_size", 1)
    if size != 1:
        raise NotImplementedError(
            f"sequence_parallel_size={size} with a PipelineModule: Ulysses sequence "
            "parallelism is not composed with pipelines yet; use a plain module (ZeRO 0-3) "
            "or set sequence_parallel_size to 1"
        )


def _sequence_parallel_grid(source: Any, mpu: Any, model: torch.nn.Module) -> Any:
    """The DP × SP (× TP with AutoTP) grid for ``sequence_parallel_size`` > 1 (None otherwise)."""
    from slipstream.config.loading import read_config_source
    from slipstream.runtime.tensor_parallel import autotp_size

    raw, _ = read_config_source(source)
    size = raw.get("sequence_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"sequence_parallel_size={size!r}: expected an integer >= 1 (1 turns Ulysses "
            "sequence parallelism off)"
        )
    if size == 1:
        return None
    if mpu is not None:
        raise NotImplementedError(
            f"sequence_parallel_size={size} with an mpu: Slipstream builds the sequence-"
            "parallel groups itself and does not read them from an mpu yet; drop mpu= (or "
            "set sequence_parallel_size to 1 and wrap attention with "
            "slipstream.comm.sequence.DistributedAttention over your own group)"
        )
    world = comm.get_world_size()
    if world % size:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide the world size {world}; choose a "
            "divisor of the number of ranks"
        )
    from slipstream.comm.sequence import SequenceParallelGrid, check_ulysses_heads

    tp = max(autotp_size(source), 1)
    if tp > 1:
        if world % (size * tp):
            raise ConfigError(
                f"sequence_parallel_size={size} × tensor_parallel.autotp_size = {tp} does not "
                f"divide the world size {world}; choose sizes whose product divides it (the "
                "data-parallel size is world / (SP × TP))",
                "sequence_parallel_size",
            )
        heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
        if isinstance(heads, int):
            try:
                check_ulysses_heads(
                    heads, getattr(model.config, "num_key_value_heads", None), size, tp
                )
            except ValueError as error:
                raise ConfigError(
                    f"sequence_parallel_size={size} with tensor_parallel.autotp_size = {tp}: "
                    f"{error}",
                    "sequence_parallel_size",
                ) from None
    return SequenceParallelGrid(size, tensor_parallel_size=tp)


def _apply_amd_specific(config: SlipstreamConfig) -> None:
    """The ``amd_specific`` block: applied on ROCm, a logged no-op elsewhere (only if set)."""
    from slipstream.kernels import get_accelerator

    block = config.amd_specific
    applied = get_accelerator().apply_amd_specific(
        block.rocm_mem_pool_init, block.rocm_stream_priority
    )
    if "amd_specific" in config.raw and comm.get_rank() == 0:
        logger.info("amd_specific: %s", applied)


def _curriculum_dataloader(
    engine: SlipstreamEngine, dataset: Dataset, collate_fn: Any, mpu: Any
) -> DataLoader | None:
    """data_efficiency.data_sampling's difficulty-based loader, when it is on (else None)."""
    if engine.data_efficiency is None:
        return None
    if mpu is not None:
        replicas, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    else:
        replicas, rank = comm.get_world_size(), comm.get_rank()
    return engine.data_efficiency.build_dataloader(
        dataset,
        data_parallel_rank=rank,
        data_parallel_size=replicas,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        collate_fn=collate_fn,
    )


def _build_dataloader(
    dataset: Dataset, config: SlipstreamConfig, collate_fn: Any, mpu: Any
) -> DataLoader:
    """A loader that gives each data-parallel rank its own micro-batches (DistributedSampler)."""
    if mpu is not None:
        replicas, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    else:
        replicas, rank = comm.get_world_size(), comm.get_rank()
    drop_last = bool(config.raw.get("dataloader_drop_last", False))
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=True, drop_last=drop_last
    )
    return DataLoader(
        dataset,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )
