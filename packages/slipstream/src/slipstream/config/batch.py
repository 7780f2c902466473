"""The batch-size triple: derive the missing values and check train = micro × GAS × world size."""

from __future__ import annotations

from typing import NamedTuple

from slipstream.kernels.config_schema import ConfigError

__all__ = ["BatchSizes", "resolve_batch_sizes"]

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"
_HOW = (
    f"Give values with {_TRAIN} = {_MICRO} × {_GAS} × data-parallel world size, or give only "
    "two of the three and let the third be derived."
)


class BatchSizes(NamedTuple):
    """A consistent batch-size triple for one data-parallel world size."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
) -> BatchSizes:
    """Fill in the batch triple the way DeepSpeed does, for ``world_size`` data-parallel ranks.

    Any two values give the third; ``train_batch_size`` alone or the micro batch alone give
    the others with one accumulation step; all three are checked. Unlike DeepSpeed, whose
    derivations floor-divide and then fail a generic assertion, an indivisible derivation is
    reported with its arithmetic.

    >>> resolve_batch_sizes(32, 4, None, world_size=2)
    BatchSizes(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"the data-parallel world size must be a positive integer, got {world_size!r}"
        )
    train, micro, gas, world = (
        train_batch_size,
        train_micro_batch_size_per_gpu,
        gradient_accumulation_steps,
        world_size,
    )
    for name, value in ((_TRAIN, train), (_MICRO, micro), (_GAS, gas)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value}", name)

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            raise ConfigError(
                f"{_TRAIN} {train} != {_MICRO} {micro} × {_GAS} {gas} × data-parallel world "
                f"size {world} = {micro * gas * world}. {_HOW}",
                _TRAIN,
            )
        return BatchSizes(train, micro, gas)
    if train is not None and micro is not None:
        return BatchSizes(train, micro, _divide(train, (_MICRO, micro), world, _GAS))
    if train is not None and gas is not None:
        return BatchSizes(train, _divide(train, (_GAS, gas), world, _MICRO), gas)
    if micro is not None and gas is not None:
        return BatchSizes(micro * gas * world, micro, gas)
    if train is not None:
        return BatchSizes(train, _divide(train, None, world, _MICRO), 1)
    if micro is not None:
        return BatchSizes(micro * world, micro, 1)
    given = f" ({_GAS} alone is not enough)" if gas is not None else ""
    raise ConfigError(
        f"the config sets no batch size{given}: set {_TRAIN} or {_MICRO} (or two of "
        f"{_TRAIN}, {_MICRO} and {_GAS}).",
        _TRAIN,
    )


def _divide(train: int, known: tuple[str, int] | None, world: int, target: str) -> int:
    """``train / (known × world)``, or a ConfigError showing why it is not a whole number."""
    divisor = world * (known[1] if known else 1)
    if train % divisor != 0:
        product = f"data-parallel world size {world}"
        if known is not None:
            product = f"{known[0]} {known[1]} × {product} = {divisor}"
        raise ConfigError(
            f"cannot derive {target}: {_TRAIN} {train} is not divisible by {product}. {_HOW}",
            _TRAIN,
        )
    return train // divisor
