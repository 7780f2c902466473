"""``init_compression`` and ``redundancy_clean``: DeepSpeed-Compression's two entry points."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from slipstream.compression.config import CompressionConfig, TechniqueGroup, compression_config
from slipstream.compression.layers import (
    ActivationQuantSettings,
    CompressionState,
    PruneSettings,
    WeightQuantSettings,
    make_compressible,
)
from slipstream.compression.quantizers import quantized_values
from slipstream.compression.scheduler import CompressionScheduler
from slipstream.kernels.config_schema import ConfigError

__all__ = ["init_compression", "redundancy_clean", "student_initialization"]

logger = logging.getLogger(__name__)

# Which module kinds each technique applies to.
_KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Embedding, nn.Conv2d),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}


def _matches(pattern: str, name: str) -> bool:
    """DeepSpeed's module scope: ``re.search`` on the full name; ``"*"`` matches every module."""
    return pattern == "*" or re.search(pattern, name) is not None


def _common_prefix(a: str, b: str) -> int:
    count = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        count += 1
    return count


def _related_names(name: str, patterns: list[str], names: list[str]) -> list[str]:
    """For each pattern, the matching modules nearest ``name`` (the longest shared prefix)."""
    found: list[str] = []
    for pattern in patterns:
        candidates = [other for other in names if other != name and _matches(pattern, other)]
        if not candidates:
            continue
        best = max(_common_prefix(name, other) for other in candidates)
        found += [other for other in candidates if _common_prefix(name, other) == best]
    return found


def _groups(
    technique: str, groups: dict[str, TechniqueGroup[Any]], model: nn.Module, excluded: list[str]
) -> list[tuple[TechniqueGroup[Any], str, list[str]]]:
    """(group, module name, related names) for every module a technique's groups cover."""
    kinds = _KINDS[technique]
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, kinds) and not any(_matches(p, name) for p in excluded)
    ]
    every = [name for name, _ in model.named_modules()]
    covered: list[tuple[TechniqueGroup[Any], str, list[str]]] = []
    for group in groups.values():
        before = len(covered)
        for index, pattern in enumerate(group.modules):
            related = group.related_modules[index] if group.related_modules else []
            for name in names:
                if _matches(pattern, name):
                    covered.append((group, name, _related_names(name, related, every)))
        if len(covered) == before:
            where = f"compression_training.{technique}.different_groups.{group.name}.modules"
            kinds_text = "/".join(kind.__name__ for kind in kinds)
            raise ConfigError(
                f"{where} = {group.modules} matches no {kinds_text} module of the model; "
                "patterns are regular expressions searched in full module names such as "
                f"{names[:3]}",
                where,
            )
    return covered


def _configure(model: nn.Module, config: CompressionConfig) -> None:
    """Make every covered module compression-aware and give it its techniques' settings."""
    weight = config.weight_quantization
    if weight.shared_parameters.enabled:
        shared = weight.shared_parameters
        mixed = shared.fp16_mixed_quantize
        for group, name, _ in _groups("weight_quantization", weight.different_groups, model, []):
            state = make_compressible(model.get_submodule(name))
            assert state is not None
            state.weight_quant = WeightQuantSettings(
                start_bits=group.params.start_bits,
                target_bits=group.params.target_bits,
                period=group.params.quantization_period,
                offset=shared.schedule_offset,
                groups=shared.quantize_groups,
                symmetric=shared.quantization_type == "symmetric",
                stochastic=shared.rounding == "stochastic",
                mixed_change_ratio=mixed.quantize_change_ratio if mixed.enabled else None,
                group_size=shared.quantize_group_size,
            )
    activation = config.activation_quantization
    if activation.shared_parameters.enabled:
        act_shared = activation.shared_parameters
        for group, name, _ in _groups(
            "activation_quantization", activation.different_groups, model, []
        ):
            state = make_compressible(model.get_submodule(name))
            assert state is not None
            state.act_quant = ActivationQuantSettings(
                bits=group.params.bits,
                offset=act_shared.schedule_offset,
                symmetric=act_shared.quantization_type == "symmetric",
                static=act_shared.range_calibration == "static",
            )
    for technique in ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning"):
        block = getattr(config, technique)
        shared = block.shared_parameters
        if not shared.enabled:
            continue
        excluded = getattr(shared, "excluded_modules", [])
        for group, name, related in _groups(technique, block.different_groups, model, excluded):
            state = make_compressible(model.get_submodule(name))
            assert state is not None
            if technique == "head_pruning":
                _check_head_related(model, name, state, related)
            state.prune[technique] = PruneSettings(
                dense_ratio=group.params.dense_ratio,
                method=shared.method,
                offset=shared.schedule_offset,
                offset_end=getattr(shared, "schedule_offset_end", None),
                stride=getattr(shared, "schedule_offset_stride", 1),
                num_heads=getattr(shared, "num_heads", None),
                related=related,
            )


def _check_head_related(
    model: nn.Module, name: str, state: CompressionState, related: list[str]
) -> None:
    """Head pruning cuts the same rows from every related projection: sizes must agree."""
    for other in related:
        weight: torch.Tensor = model.get_submodule(other).weight  # type: ignore[assignment]
        width = weight.shape[0]
        if width != state.weight.shape[1]:
            raise NotImplementedError(
                f"head pruning of {name}: related module {other} has {width} output features "
                f"but {name} reads {state.weight.shape[1]}; grouped-query attention (fewer "
                "key/value heads than query heads) cannot be head-pruned yet"
            )


def student_initialization(
    student: nn.Module, teacher: nn.Module | None, config: CompressionConfig
) -> None:
    """Layer reduction: keep ``teacher_layer`` layers (copied from ``teacher`` when given).

    Without a teacher the model itself is the teacher: its ModuleList at ``module_name_prefix``
    is cut down to the listed layers. With a teacher, the student's (already short) list gets
    the teacher's listed layers' weights, and ``other_module_name`` modules are copied too.
    """
    reduction = config.layer_reduction
    where = "compression_training.layer_reduction"
    prefix = reduction.module_name_prefix
    try:
        layers = student.get_submodule(prefix)
    except AttributeError:
        raise ConfigError(
            f"{where}.module_name_prefix = {prefix!r} names no module of the model",
            f"{where}.module_name_prefix",
        ) from None
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"{where}.module_name_prefix = {prefix!r} is a {type(layers).__name__}, not the "
            "ModuleList of the layers",
            f"{where}.module_name_prefix",
        )
    source = layers if teacher is None else teacher.get_submodule(prefix)
    assert isinstance(source, nn.ModuleList)
    bad = [index for index in reduction.teacher_layer if index >= len(source)]
    if bad:
        raise ConfigError(
            f"{where}.teacher_layer = {reduction.teacher_layer} names layers {bad} but the "
            f"teacher has {len(source)} layers",
            f"{where}.teacher_layer",
        )
    if teacher is None:
        parent_name, _, leaf = prefix.rpartition(".")
        parent = student.get_submodule(parent_name) if parent_name else student
        setattr(parent, leaf, nn.ModuleList(source[i] for i in reduction.teacher_layer))
        layers = getattr(parent, leaf)
    else:
        if len(layers) != len(reduction.teacher_layer):
            raise ConfigError(
                f"{where}.keep_number_layer = {reduction.keep_number_layer} but the student "
                f"model has {len(layers)} layers at {prefix!r}; build the student with "
                "keep_number_layer layers (or pass teacher_model=None to cut the model itself)",
                f"{where}.keep_number_layer",
            )
        with torch.no_grad():
            for student_layer, index in zip(layers, reduction.teacher_layer):
                student_layer.load_state_dict(source[index].state_dict())
            for name in reduction.other_module_name:
                student.get_submodule(name).load_state_dict(
                    teacher.get_submodule(name).state_dict()
                )
    for index, layer in enumerate(layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index  # KV-cache slots of Hugging Face attention
    hf_config = getattr(student, "config", None)
    if hf_config is not None and hasattr(hf_config, "num_hidden_layers"):
        hf_config.num_hidden_layers = len(layers)


def init_compression(
    model: nn.Module,
    deepspeed_config: Any,
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Prepare ``model`` for compression as the ``compression_training`` block asks.

    Layer reduction runs first (with ``teacher_model`` as the source of the kept layers), then
    every module that a technique's ``different_groups`` cover becomes compression-aware (in
    place; parameters are kept). The techniques act from their ``schedule_offset`` on: drive
    them with :class:`CompressionScheduler` (``slipstream.initialize`` does it each step).

    Args:
        model: the model (a Hugging Face model or any ``nn.Module``).
        deepspeed_config: a whole DeepSpeed config (dict or JSON path) or a CompressionConfig.
        teacher_model: layer reduction's source of the kept layers.
        mpu: model-parallel unit; tensor-parallel compression is not supported (must be 1).

    Returns:
        the same model, compressed in place.

    >>> model = nn.Sequential(nn.Linear(8, 8))
    >>> model = init_compression(model, {"compression_training": {"weight_quantization": {
    ...     "shared_parameters": {"enabled": True},
    ...     "different_groups": {"wq1": {"params": {"start_bits": 4, "target_bits": 4}}}}}})
    """
    _check_mpu(mpu)
    config = compression_config(deepspeed_config)
    if config.layer_reduction.enabled:
        student_initialization(model, teacher_model, config)
    _configure(model, config)
    CompressionScheduler(model, config)  # the state of step 0: offsets of 0 act at once
    return model


def _check_mpu(mpu: Any) -> None:
    if mpu is not None and mpu.get_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "compression of a tensor-parallel model (mpu with model parallel size "
            f"{mpu.get_model_parallel_world_size()}) is not implemented; compress the "
            "unsharded model and shard it for inference afterwards"
        )


# --------------------------------------------------------------------------- redundancy_clean


def _replace_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _keep_rows(module: nn.Module, keep: torch.Tensor) -> None:
    assert isinstance(module, (nn.Linear, nn.Conv2d))
    _replace_param(module, "weight", module.weight.detach()[keep])
    if module.bias is not None:
        _replace_param(module, "bias", module.bias.detach()[keep])
    if isinstance(module, nn.Linear):
        module.out_features = int(keep.numel())
    else:
        module.out_channels = int(keep.numel())


def _keep_columns(module: nn.Module, keep: torch.Tensor) -> None:
    if isinstance(module, nn.Linear):
        _replace_param(module, "weight", module.weight.detach()[:, keep])
        module.in_features = int(keep.numel())
    elif isinstance(module, nn.Conv2d):
        _replace_param(module, "weight", module.weight.detach()[:, keep])
        module.in_channels = int(keep.numel())
    elif isinstance(module, nn.BatchNorm2d):  # the norm right after a channel-pruned conv
        for name in ("weight", "bias"):
            if getattr(module, name) is not None:
                _replace_param(module, name, getattr(module, name).detach()[keep])
        for name in ("running_mean", "running_var"):
            if getattr(module, name) is not None:
                setattr(module, name, getattr(module, name)[keep].clone())
        module.num_features = int(keep.numel())
    else:
        raise NotImplementedError(
            f"related module of type {type(module).__name__} cannot lose input features; "
            "list only Linear, Conv2d and BatchNorm2d modules in related_modules"
        )


def _is_sibling(module: nn.Module, shape: tuple[int, ...]) -> bool:
    """A related Linear with the pruned one's (non-square) shape is a sibling that reads the same
    input and loses the same rows (Llama's gate_proj beside a row-pruned up_proj); any other
    related module follows the pruned one and loses input columns (DeepSpeed's meaning)."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Linear)
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == shape
        and shape[0] != shape[1]
    )


def _final_mask(state: CompressionState, technique: str) -> torch.Tensor:
    """The mask in use (what the last forward applied), or one at the final dense ratio."""
    mask = state.masks.get(technique)
    if mask is None:
        mask = state.compute_mask(technique, state.prune[technique].dense_ratio)
    return mask


def _note_heads(model: nn.Module, related: list[str], kept: int, head_dim: int) -> None:
    """Tell the attention module owning the projections how many heads it has left."""
    for name in related:
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for candidate in (parent, model.get_submodule(parent_name.rpartition(".")[0])):
            for attribute in ("num_attention_heads", "num_heads"):
                if isinstance(getattr(candidate, attribute, None), int):
                    setattr(candidate, attribute, kept)
            if isinstance(getattr(candidate, "all_head_size", None), int):
                candidate.all_head_size = kept * head_dim  # type: ignore[assignment]


@torch.no_grad()
def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Make the compression final: smaller shapes for pruned units, weights on their grid.

    - row pruning: the pruned output rows of each Linear (and its bias) are removed, and the
      matching input columns of its ``related_modules``;
    - head pruning: the pruned heads' input columns of the output projection are removed, and
      the matching rows of the related query/key/value projections; the attention module's
      ``num_attention_heads``/``num_heads``/``all_head_size`` follow;
    - channel pruning: the same for Conv2d output channels and the related convs' inputs;
    - sparse pruning: the mask is multiplied into the weight;
    - weight quantization: the weight is replaced by its values on the ``target_bits`` grid,
      and the module keeps ``weight_bits`` so that ``save_compressed`` can pack it.

    The Hugging Face ``config`` follows where the change is uniform (``intermediate_size``,
    ``num_attention_heads``/``num_key_value_heads``/``head_dim``). The cleaned model's outputs
    equal the masked model's.
    """
    _check_mpu(mpu)
    compression_config(deepspeed_config)  # validated: a bad block fails before any change
    states = [(n, m) for n, m in model.named_modules() if isinstance(m, CompressionState)]
    # 1. Every mask and the quantization go into the weights at their full shapes (what the
    # masked model computes); 2. then the pruned rows, heads and channels are cut out.
    for _, state in states:
        for technique in state.prune:
            state.set_prune_ratio(technique, state.prune[technique].dense_ratio)
            state.masks[technique] = _final_mask(state, technique)
        full, rows = state.weight_masks()
        if full is not None:
            state.weight.mul_(full)
        if rows is not None and getattr(state, "bias", None) is not None:
            state.bias.mul_(rows.to(state.bias.dtype))  # type: ignore[attr-defined]
        if state.weight_quant is not None:
            settings_q = state.weight_quant
            state.weight_bits = settings_q.target_bits
            state.weight.copy_(
                quantized_values(
                    state.weight,
                    settings_q.target_bits,
                    settings_q.groups_for(state.weight),
                    settings_q.symmetric,
                )
            )
            settings_q.mixed_change_ratio = None
            state.baked = True
        if state.act_quant is not None:
            state.act_bits = state.act_quant.bits
    row_sizes: dict[int, set[int]] = {}
    head_counts: dict[int, set[int]] = {}
    for _, state in states:
        for technique in ("row_pruning", "channel_pruning"):
            if technique not in state.prune:
                continue
            keep = _final_mask(state, technique).nonzero().flatten()
            before = state.weight.shape[0]
            shape = tuple(state.weight.shape)
            _keep_rows(state, keep)  # type: ignore[arg-type]
            row_sizes.setdefault(before, set()).add(int(keep.numel()))
            for other in state.prune[technique].related:
                related = model.get_submodule(other)
                if _is_sibling(related, shape):
                    _keep_rows(related, keep)
                else:
                    _keep_columns(related, keep)
            state.prune.pop(technique)
            state.set_prune_ratio(technique, None)
        if "head_pruning" in state.prune:
            settings = state.prune["head_pruning"]
            heads = _final_mask(state, "head_pruning")
            assert settings.num_heads is not None
            head_dim = state.weight.shape[1] // settings.num_heads
            columns = (
                heads.nonzero().flatten()[:, None] * head_dim
                + torch.arange(head_dim, device=heads.device)
            ).flatten()
            kept = int(heads.sum())
            _keep_columns(state, columns)  # type: ignore[arg-type]
            for other in settings.related:
                _keep_rows(model.get_submodule(other), columns)
            _note_heads(model, settings.related, kept, head_dim)
            head_counts.setdefault(settings.num_heads, set()).add(kept)
            state.prune.pop("head_pruning")
            state.set_prune_ratio("head_pruning", None)
        if "sparse_pruning" in state.prune:  # already in the weight
            state.prune.pop("sparse_pruning")
            state.set_prune_ratio("sparse_pruning", None)
    _update_hf_config(model, row_sizes, head_counts)
    return model


def _update_hf_config(
    model: nn.Module, row_sizes: dict[int, set[int]], head_counts: dict[int, set[int]]
) -> None:
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        return
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate in row_sizes and len(row_sizes[intermediate]) == 1:
        hf_config.intermediate_size = next(iter(row_sizes[intermediate]))
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads in head_counts and len(head_counts[heads]) == 1:
        hidden = getattr(hf_config, "hidden_size", None)
        head_dim = getattr(hf_config, "head_dim", None) or (hidden // heads if hidden else None)
        kept = next(iter(head_counts[heads]))
        hf_config.num_attention_heads = kept
        if getattr(hf_config, "num_key_value_heads", None) == heads:
            hf_config.num_key_value_heads = kept
        if head_dim is not None and hasattr(hf_config, "head_dim"):
            hf_config.head_dim = head_dim
