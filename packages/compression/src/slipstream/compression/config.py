"""Typed ``compression_training`` block: DeepSpeed-Compression's keys, defaults and layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar

from slipstream.kernels.config_schema import (
    ConfigBlock,
    ConfigError,
    config_fail,
    key_path,
    not_implemented,
    unknown_keys_error,
)

__all__ = [
    "ActivationQuantizationConfig",
    "ActivationQuantizationParams",
    "ActivationQuantizationShared",
    "ChannelPruningConfig",
    "CompressionConfig",
    "FP16MixedQuantizeConfig",
    "HeadPruningConfig",
    "HeadPruningShared",
    "LayerReductionConfig",
    "PruningParams",
    "PruningShared",
    "RowPruningConfig",
    "SparsePruningConfig",
    "SparsePruningShared",
    "TechniqueGroup",
    "WeightQuantizationConfig",
    "WeightQuantizationParams",
    "WeightQuantizationShared",
    "compression_config",
]

_Params = TypeVar("_Params", bound=ConfigBlock)


def _offset(default: int) -> Any:
    return dataclasses.field(default=default, metadata={"ge": 0})


def _dense_ratio() -> Any:
    return dataclasses.field(metadata={"gt": 0, "le": 1})


# --------------------------------------------------------------------------- groups


@dataclasses.dataclass(kw_only=True)
class TechniqueGroup(Generic[_Params]):
    """One entry of a technique's ``different_groups``: its params and the modules it covers.

    Attributes:
        name: the group's key in ``different_groups``.
        params: the technique's per-group parameters.
        modules: module-name patterns (``re.search`` on the full name; ``"*"`` = every module).
        related_modules: per pattern of ``modules``, the patterns of modules whose inputs follow
            the pruned outputs (row/head/channel pruning: they lose the matching columns).
    """

    name: str
    params: _Params
    modules: list[str]
    related_modules: list[list[str]] | None


def _groups_metadata(params: type[ConfigBlock]) -> dict[str, Any]:
    """A ``different_groups`` field: ``{name: {params, modules, related_modules}}``."""

    def parse(value: Any, path: str) -> dict[str, TechniqueGroup[Any]]:
        if not isinstance(value, Mapping):
            config_fail(path, value, "an object mapping group names to {params, modules}")
        groups: dict[str, TechniqueGroup[Any]] = {}
        for name, body in value.items():
            where = key_path(path, str(name))
            if not isinstance(body, Mapping):
                config_fail(where, body, "an object with params, modules and related_modules")
            unknown = [k for k in body if k not in ("params", "modules", "related_modules")]
            if unknown:
                raise unknown_keys_error(where, unknown, ["params", "modules", "related_modules"])
            if "params" not in body:
                raise ConfigError(
                    f"missing required config key '{key_path(where, 'params')}' (the group's "
                    f"{params.__name__} fields)",
                    key_path(where, "params"),
                )
            modules = body.get("modules", ["*"])
            if isinstance(modules, str):
                modules = [modules]
            if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
                config_fail(key_path(where, "modules"), modules, "a list of module-name patterns")
            related = body.get("related_modules")
            if related is not None and (
                not isinstance(related, list)
                or not all(
                    isinstance(r, list) and all(isinstance(s, str) for s in r) for r in related
                )
            ):
                config_fail(
                    key_path(where, "related_modules"),
                    related,
                    "a list (one per pattern of modules) of lists of module-name patterns",
                )
            if related is not None and len(related) != len(modules):
                raise ConfigError(
                    f"{key_path(where, 'related_modules')} has {len(related)} entries and "
                    f"{key_path(where, 'modules')} {len(modules)}: give one list of related "
                    "patterns per module pattern",
                    key_path(where, "related_modules"),
                )
            groups[str(name)] = TechniqueGroup(
                name=str(name),
                params=params.from_dict(body["params"], key_path(where, "params")),
                modules=list(modules),
                related_modules=related,
            )
        return groups

    def dump(groups: dict[str, TechniqueGroup[Any]]) -> dict[str, Any]:
        return {
            name: {
                "params": group.params.to_dict(),
                "modules": group.modules,
                **({"related_modules": group.related_modules} if group.related_modules else {}),
            }
            for name, group in groups.items()
        }

    return {"parser": parse, "serializer": dump}


# --------------------------------------------------------------------------- weight quantization


@dataclasses.dataclass(kw_only=True)
class FP16MixedQuantizeConfig(ConfigBlock):
    """``fp16_mixed_quantize``: blend the fp16 and quantized weight, moving to fully quantized.

    Attributes:
        enabled: switch the blend on.
        quantize_change_ratio: how much the quantized share grows per step.
    """

    enabled: bool = False
    quantize_change_ratio: float = dataclasses.field(default=0.001, metadata={"gt": 0, "le": 1})


@dataclasses.dataclass(kw_only=True)
class WeightQuantizationShared(ConfigBlock):
    """``weight_quantization.shared_parameters`` (DeepSpeed's keys and defaults).

    Attributes:
        enabled: switch weight quantization on.
        quantizer_kernel: DeepSpeed's CUDA quantizer switch; accepted (the fake-quant is torch).
        schedule_offset: first step at which weights are quantized.
        quantize_groups: groups the flattened weight is split into, each with its own scale.
        quantize_verbose: log each change of bits.
        quantization_type: ``"symmetric"`` or ``"asymmetric"``.
        quantize_weight_in_forward: DeepSpeed's switch between quantizing in the forward and in
            the optimizer step; Slipstream always quantizes in the forward (same numbers).
        rounding: ``"nearest"`` or ``"stochastic"``.
        fp16_mixed_quantize: blend from the full-precision to the quantized weight.
        quantize_group_size: Slipstream's key: elements per group along each row (it replaces
            ``quantize_groups``, whose groups may straddle rows). The packed export of int8 and
            int4 weights is served by ``slipstream.inference`` exactly when every quantized
            weight uses the same row-aligned group size (``quant.weight.group_size`` there).
    """

    enabled: bool = False
    quantizer_kernel: bool = False
    schedule_offset: int = _offset(0)
    quantize_groups: int = dataclasses.field(default=1, metadata={"ge": 1})
    quantize_verbose: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    quantize_weight_in_forward: bool = False
    rounding: Literal["nearest", "stochastic"] = "nearest"
    fp16_mixed_quantize: FP16MixedQuantizeConfig = dataclasses.field(
        default_factory=FP16MixedQuantizeConfig
    )
    quantize_group_size: int | None = dataclasses.field(default=None, metadata={"ge": 1})


@dataclasses.dataclass(kw_only=True)
class WeightQuantizationParams(ConfigBlock):
    """A weight-quantization group's ``params``.

    Attributes:
        start_bits: bits at ``schedule_offset``.
        target_bits: bits reached after stepping down one bit per ``quantization_period``.
        quantization_period: steps between two one-bit reductions.
    """

    start_bits: int = dataclasses.field(metadata={"ge": 1, "le": 16})
    target_bits: int = dataclasses.field(metadata={"ge": 1, "le": 16})
    quantization_period: int = dataclasses.field(default=1, metadata={"ge": 1})

    def validate(self, path: str) -> None:
        if self.target_bits > self.start_bits:
            raise ConfigError(
                f"{key_path(path, 'target_bits')} = {self.target_bits} is above "
                f"{key_path(path, 'start_bits')} = {self.start_bits}: bits only go down "
                "during training; set start_bits >= target_bits",
                key_path(path, "target_bits"),
            )


@dataclasses.dataclass(kw_only=True)
class WeightQuantizationConfig(ConfigBlock):
    """``compression_training.weight_quantization``."""

    shared_parameters: WeightQuantizationShared = dataclasses.field(
        default_factory=WeightQuantizationShared
    )
    different_groups: dict[str, TechniqueGroup[WeightQuantizationParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(WeightQuantizationParams)
    )

    def validate(self, path: str) -> None:
        shared = self.shared_parameters
        if shared.quantization_type == "asymmetric":
            for group in self.different_groups.values():
                if group.params.target_bits < 3:
                    config_fail(
                        key_path(path, f"different_groups.{group.name}.params.target_bits"),
                        group.params.target_bits,
                        ">= 3 with asymmetric quantization (1 and 2 bits are binary and "
                        "ternary, which are symmetric): use quantization_type symmetric",
                    )


# --------------------------------------------------------------------------- activations


@dataclasses.dataclass(kw_only=True)
class ActivationQuantizationShared(ConfigBlock):
    """``activation_quantization.shared_parameters``.

    Attributes:
        enabled: switch activation quantization on (the inputs of matched Linear layers).
        quantization_type: ``"symmetric"`` or ``"asymmetric"``.
        range_calibration: ``"dynamic"`` (each token's own range) or ``"static"`` (a running
            range kept during training, then fixed).
        schedule_offset: first step at which activations are quantized.
    """

    enabled: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    schedule_offset: int = _offset(1000)


@dataclasses.dataclass(kw_only=True)
class ActivationQuantizationParams(ConfigBlock):
    """An activation-quantization group's ``params``: ``bits`` (DeepSpeed supports 4 and 8)."""

    bits: int = dataclasses.field(metadata={"ge": 2, "le": 16})


@dataclasses.dataclass(kw_only=True)
class ActivationQuantizationConfig(ConfigBlock):
    """``compression_training.activation_quantization``."""

    shared_parameters: ActivationQuantizationShared = dataclasses.field(
        default_factory=ActivationQuantizationShared
    )
    different_groups: dict[str, TechniqueGroup[ActivationQuantizationParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(ActivationQuantizationParams)
    )


# --------------------------------------------------------------------------- pruning


@dataclasses.dataclass(kw_only=True)
class PruningParams(ConfigBlock):
    """A pruning group's ``params``: ``dense_ratio``, the share of weights/rows/heads kept."""

    dense_ratio: float = _dense_ratio()


@dataclasses.dataclass(kw_only=True)
class SparsePruningShared(ConfigBlock):
    """``sparse_pruning.shared_parameters``.

    Attributes:
        enabled: switch unstructured pruning on.
        method: ``"l1"`` (magnitude mask fixed when pruning starts) or ``"topk"`` (magnitude
            mask recomputed every forward, so pruned weights can come back).
        schedule_offset: first step with a mask.
        schedule_offset_end: with ``schedule_offset_stride``, prune gradually: the kept share
            falls linearly from 1 at ``schedule_offset`` to ``dense_ratio`` at this step.
        schedule_offset_stride: steps between two updates of a gradual mask.
        dense_ratio, block_pattern, excluded_modules: DeepSpeed's snip_momentum keys.
    """

    enabled: bool = False
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    schedule_offset: int = _offset(1000)
    schedule_offset_end: int | None = dataclasses.field(default=None, metadata={"ge": 0})
    schedule_offset_stride: int = dataclasses.field(default=1, metadata={"ge": 1})
    dense_ratio: float | None = dataclasses.field(default=None, metadata={"gt": 0, "le": 1})
    block_pattern: str = "4x1"
    excluded_modules: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str) -> None:
        if self.enabled and self.method == "snip_momentum":
            not_implemented(
                key_path(path, "method"),
                self.method,
                "SNIP-momentum block pruning",
                "a later release of slipstream-compression",
                'Use "l1" or "topk" (with schedule_offset_end for gradual pruning).',
            )
        if self.schedule_offset_end is not None and self.schedule_offset_end < self.schedule_offset:
            config_fail(
                key_path(path, "schedule_offset_end"),
                self.schedule_offset_end,
                f"a step >= schedule_offset ({self.schedule_offset})",
            )


@dataclasses.dataclass(kw_only=True)
class SparsePruningConfig(ConfigBlock):
    """``compression_training.sparse_pruning``: unstructured magnitude pruning."""

    shared_parameters: SparsePruningShared = dataclasses.field(default_factory=SparsePruningShared)
    different_groups: dict[str, TechniqueGroup[PruningParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(PruningParams)
    )


@dataclasses.dataclass(kw_only=True)
class PruningShared(ConfigBlock):
    """``shared_parameters`` of row and channel pruning.

    Attributes:
        enabled: switch the technique on.
        method: ``"l1"`` (mask fixed when pruning starts) or ``"topk"`` (recomputed each forward).
        schedule_offset: first step with a mask.
    """

    enabled: bool = False
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: int = _offset(1000)


@dataclasses.dataclass(kw_only=True)
class RowPruningConfig(ConfigBlock):
    """``compression_training.row_pruning``: output features of Linear layers."""

    shared_parameters: PruningShared = dataclasses.field(default_factory=PruningShared)
    different_groups: dict[str, TechniqueGroup[PruningParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(PruningParams)
    )


@dataclasses.dataclass(kw_only=True)
class ChannelPruningConfig(ConfigBlock):
    """``compression_training.channel_pruning``: output channels of Conv2d layers."""

    shared_parameters: PruningShared = dataclasses.field(default_factory=PruningShared)
    different_groups: dict[str, TechniqueGroup[PruningParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(PruningParams)
    )


@dataclasses.dataclass(kw_only=True)
class HeadPruningShared(ConfigBlock):
    """``head_pruning.shared_parameters``.

    Attributes:
        enabled: switch head pruning on.
        method: ``"topk"`` (default) or ``"l1"``.
        schedule_offset: first step with a mask.
        num_heads: attention heads of the pruned projection's input (required when enabled).
    """

    enabled: bool = False
    method: Literal["l1", "topk"] = "topk"
    schedule_offset: int = _offset(1000)
    num_heads: int | None = dataclasses.field(default=None, metadata={"ge": 1})

    def validate(self, path: str) -> None:
        if self.enabled and self.num_heads is None:
            raise ConfigError(
                f"missing config key '{key_path(path, 'num_heads')}': head pruning needs the "
                "number of attention heads of the pruned layers",
                key_path(path, "num_heads"),
            )


@dataclasses.dataclass(kw_only=True)
class HeadPruningConfig(ConfigBlock):
    """``compression_training.head_pruning``: input heads of attention output projections."""

    shared_parameters: HeadPruningShared = dataclasses.field(default_factory=HeadPruningShared)
    different_groups: dict[str, TechniqueGroup[PruningParams]] = dataclasses.field(
        default_factory=dict, metadata=_groups_metadata(PruningParams)
    )


# --------------------------------------------------------------------------- layer reduction


@dataclasses.dataclass(kw_only=True)
class LayerReductionConfig(ConfigBlock):
    """``compression_training.layer_reduction``: keep some layers, initialised from a teacher's.

    Attributes:
        enabled: switch layer reduction on.
        keep_number_layer: layers the student keeps.
        module_name_prefix: the name of the layers' ModuleList (``bert.encoder.layer``).
        teacher_layer: for each kept layer, the teacher layer it is initialised from.
        other_module_name: other modules copied from the teacher (embeddings, head, ...).
    """

    enabled: bool = False
    keep_number_layer: int | None = dataclasses.field(default=None, metadata={"ge": 1})
    module_name_prefix: str = ""
    teacher_layer: list[int] = dataclasses.field(default_factory=list)
    other_module_name: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        if not self.module_name_prefix:
            raise ConfigError(
                f"missing config key '{key_path(path, 'module_name_prefix')}': layer reduction "
                "needs the name of the layers' ModuleList (e.g. bert.encoder.layer)",
                key_path(path, "module_name_prefix"),
            )
        if self.keep_number_layer is None:
            self.keep_number_layer = len(self.teacher_layer)
        if len(self.teacher_layer) != self.keep_number_layer:
            raise ConfigError(
                f"{key_path(path, 'teacher_layer')} names {len(self.teacher_layer)} layers but "
                f"{key_path(path, 'keep_number_layer')} = {self.keep_number_layer}: give one "
                "teacher layer per kept layer",
                key_path(path, "teacher_layer"),
            )
        if any(index < 0 for index in self.teacher_layer):
            config_fail(key_path(path, "teacher_layer"), self.teacher_layer, "layer indices >= 0")


# --------------------------------------------------------------------------- the block


@dataclasses.dataclass(kw_only=True)
class CompressionConfig(ConfigBlock):
    """The ``compression_training`` block: one sub-block per technique, all off by default.

    >>> config = CompressionConfig.from_dict({"weight_quantization": {
    ...     "shared_parameters": {"enabled": True},
    ...     "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}}}}})
    >>> config.weight_quantization.different_groups["wq1"].modules
    ['*']
    """

    weight_quantization: WeightQuantizationConfig = dataclasses.field(
        default_factory=WeightQuantizationConfig
    )
    activation_quantization: ActivationQuantizationConfig = dataclasses.field(
        default_factory=ActivationQuantizationConfig
    )
    sparse_pruning: SparsePruningConfig = dataclasses.field(default_factory=SparsePruningConfig)
    row_pruning: RowPruningConfig = dataclasses.field(default_factory=RowPruningConfig)
    head_pruning: HeadPruningConfig = dataclasses.field(default_factory=HeadPruningConfig)
    channel_pruning: ChannelPruningConfig = dataclasses.field(default_factory=ChannelPruningConfig)
    layer_reduction: LayerReductionConfig = dataclasses.field(default_factory=LayerReductionConfig)

    @property
    def enabled(self) -> bool:
        """Whether any technique is switched on."""
        return self.layer_reduction.enabled or any(
            technique.shared_parameters.enabled for technique in self.techniques().values()
        )

    def techniques(self) -> dict[str, Any]:
        """The grouped techniques by key (every one but layer reduction)."""
        return {
            "weight_quantization": self.weight_quantization,
            "activation_quantization": self.activation_quantization,
            "sparse_pruning": self.sparse_pruning,
            "row_pruning": self.row_pruning,
            "head_pruning": self.head_pruning,
            "channel_pruning": self.channel_pruning,
        }


def compression_config(config: Any) -> CompressionConfig:
    """The ``compression_training`` block of a whole config, whatever form it comes in.

    Accepts a :class:`CompressionConfig`, a dict or JSON path holding a whole DeepSpeed config
    (``compression_training`` read from it), or any object with a ``compression_training``
    attribute (the umbrella's ``SlipstreamConfig``).
    """
    if isinstance(config, CompressionConfig):
        return config
    block = getattr(config, "compression_training", None)
    if isinstance(block, CompressionConfig):
        return block
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        import json
        from pathlib import Path

        config = json.loads(Path(config).read_text())  # type: ignore[arg-type]
    if not isinstance(config, Mapping):
        config_fail("", config, "a DeepSpeed config (dict or JSON path) or a CompressionConfig")
    return CompressionConfig.from_dict(
        config.get("compression_training", {}), "compression_training"
    )
