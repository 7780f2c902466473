"""DeepSpeed top-level keys that are recognised but not implemented yet, and when they are inert.

Each entry says what the key switches on, which package will bring it, and how to tell an
inert value (``{"enabled": false}``, all defaults) from one that asks for the feature. Inert
values are accepted and kept; active ones raise NotImplementedFeatureError. When a package
implements a feature, it replaces its entry here with a typed ConfigBlock field on
SlipstreamConfig.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from slipstream.config.feature_rules import (
    ActivePredicate,
    always,
    data_types_active,
    enabled_flag,
    non_default,
    present_unless_false,
    scalar,
)
from slipstream.kernels.config_schema import (
    ConfigError,
    NotImplementedFeatureError,
    key_path,
    show_value,
)

__all__ = ["RECOGNISED_FEATURES", "RecognisedFeature", "check_recognised_features"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecognisedFeature:
    """A DeepSpeed top-level key that Slipstream knows but does not implement yet.

    Attributes:
        key: the top-level config key.
        feature: what the key switches on, in words.
        provider: the package or release that will implement it; None for a retired
            DeepSpeed key that will not come back (``replacement`` says what to use).
        is_active: ``(value, path) -> bool``; validates the value and says whether it asks
            for the feature (an inert value is accepted).
        inert: the inert form, for the docs and error messages.
        replacement: for retired keys, what to write instead.
        ignored: a legacy key that DeepSpeed accepts and ignores; Slipstream does the same and
            logs a notice saying so.
    """

    key: str
    feature: str
    provider: str | None
    is_active: ActivePredicate
    inert: str
    replacement: str = ""
    ignored: bool = False


def _ignored(check: ActivePredicate) -> ActivePredicate:
    """An accepted-and-ignored legacy key: its value is checked, and it never asks for anything."""

    def is_active(value: Any, path: str) -> bool:
        check(value, path)
        return False

    return is_active


_UMBRELLA_LATER = "a later release of the slipstream package"
_OFF = '{"enabled": false}'


RECOGNISED_FEATURES: dict[str, RecognisedFeature] = {
    entry.key: entry
    for entry in [
        RecognisedFeature(
            "flops_profiler",
            "the flops profiler",
            "slipstream's profiler (" + _UMBRELLA_LATER + ")",
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature(
            "quantize_training",
            "quantization-aware training (MoQ)",
            "the slipstream-compression package",
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature(
            "weight_quantization",
            "weight quantization",
            "the slipstream-compression package",
            enabled_flag(default=True),
            _OFF,
        ),
        RecognisedFeature(
            "eigenvalue",
            "eigenvalue computation (for MoQ)",
            "the slipstream-compression package",
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature("elasticity", "elastic training", _UMBRELLA_LATER, enabled_flag(), _OFF),
        RecognisedFeature("autotuning", "the autotuner", _UMBRELLA_LATER, enabled_flag(), _OFF),
        RecognisedFeature(
            "sparse_attention",
            "sparse attention",
            "the slipstream-kernels package (a later release)",
            always(True),
            "(none: remove the block)",
        ),
        RecognisedFeature(
            "data_types",
            "per-tensor data types",
            _UMBRELLA_LATER,
            data_types_active,
            '{"grad_accum_dtype": null} or "fp32"',
        ),
        RecognisedFeature(
            "compile",
            "DeepCompile",
            _UMBRELLA_LATER,
            enabled_flag(key="deepcompile"),
            '{"deepcompile": false}',
        ),
        RecognisedFeature(
            "hybrid_engine",
            "the RLHF hybrid engine",
            "the slipstream-inference package",
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature(
            "nebula", "Nebula asynchronous checkpointing", _UMBRELLA_LATER, enabled_flag(), _OFF
        ),
        RecognisedFeature(
            "datastates_ckpt",
            "DataStates asynchronous checkpointing",
            _UMBRELLA_LATER,
            present_unless_false,
            "false",
        ),
        RecognisedFeature(
            "casync_ckpt",
            "asynchronous checkpointing",
            _UMBRELLA_LATER,
            present_unless_false,
            "false",
        ),
        RecognisedFeature(
            "torch_autocast",
            "torch.autocast mixed precision",
            _UMBRELLA_LATER,
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature(
            "expert_parallel",
            "AutoEP expert parallelism",
            "the slipstream-moe package",
            enabled_flag(),
            _OFF,
        ),
        RecognisedFeature(
            "seq_parallel_communication_data_type",
            "a sequence-parallel communication dtype",
            "the slipstream-comm package",
            scalar("fp32", (str,), "a dtype name"),
            '"fp32"',
        ),
        RecognisedFeature(
            "seq_parallel_comm_data_type",
            "a sequence-parallel communication dtype",
            "the slipstream-comm package",
            scalar("fp32", (str,), "a dtype name"),
            '"fp32"',
        ),
        RecognisedFeature(
            "use_data_before_expert_parallelism",
            "data-before-expert process-group order",
            "the slipstream-moe package",
            scalar(False, (bool,), "a boolean"),
            "false",
        ),
        RecognisedFeature(
            "disable_allgather",
            "nothing (DeepSpeed parses it and never reads it)",
            None,
            _ignored(scalar(False, (bool,), "a boolean")),
            "true or false",
            ignored=True,
        ),
        RecognisedFeature(
            "sparse_gradients",
            "sparse (CSR) gradients",
            _UMBRELLA_LATER,
            scalar(False, (bool,), "a boolean"),
            "false",
        ),
        RecognisedFeature(
            "memory_breakdown",
            "the memory breakdown report",
            _UMBRELLA_LATER,
            scalar(False, (bool,), "a boolean"),
            "false",
        ),
        RecognisedFeature(
            "graph_harvesting",
            "graph harvesting",
            _UMBRELLA_LATER,
            scalar(False, (bool,), "a boolean"),
            "false",
        ),
        RecognisedFeature(
            "disable_python_gc",
            "disabling Python's cyclic garbage collector",
            _UMBRELLA_LATER,
            scalar(False, (bool,), "a boolean"),
            "false",
        ),
        RecognisedFeature(
            "managed_gradient_accumulation",
            "client-managed gradient accumulation (false)",
            _UMBRELLA_LATER,
            scalar(True, (bool,), "a boolean"),
            "true",
        ),
        RecognisedFeature(
            "gradient_allreduce_op",
            'summed gradients ("sum")',
            _UMBRELLA_LATER,
            scalar("mean", (str,), '"mean" or "sum"'),
            '"mean"',
        ),
        RecognisedFeature(
            "log_level",
            "DeepSpeed's log-level setting",
            _UMBRELLA_LATER,
            scalar(None, (str, int, type(None)), "a log level name or number"),
            "null",
        ),
        RecognisedFeature(
            "timers",
            "throughput-timer settings",
            _UMBRELLA_LATER,
            non_default({"throughput": {"enabled": True, "synchronized": True}}),
            'the defaults ({"throughput": {"enabled": true, "synchronized": true}})',
        ),
        RecognisedFeature(
            "vocabulary_size",
            "a vocabulary-size hint (DeepSpeed only warns about it)",
            None,
            always(False),
            "any integer",
            ignored=True,
        ),
        RecognisedFeature(
            "allgather_size",
            'the legacy companion of "zero_optimization": true',
            None,
            always(False),
            "any integer",
            ignored=True,
        ),
        RecognisedFeature(
            "amp",
            "NVIDIA Apex AMP",
            None,
            enabled_flag(),
            _OFF,
            'Apex AMP is not supported; use "fp16": {"enabled": true} or "bf16": {"enabled": true}.',
        ),
        RecognisedFeature(
            "fp32_allreduce",
            "fp32 gradient all-reduce",
            None,
            scalar(False, (bool,), "a boolean"),
            "false",
            'this older DeepSpeed key was replaced by "communication_data_type": "fp32"; use that.',
        ),
    ]
}


def check_recognised_features(blocks: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Check the recognised-but-unimplemented keys of a config; return the inert ones.

    Raises:
        NotImplementedFeatureError: one or more keys ask for a feature this release lacks
            (all of them are listed, each with the package that will provide it).
        ConfigError: a retired DeepSpeed key is switched on, or a value has the wrong shape.
    """
    active: list[str] = []
    first_active: str | None = None
    for key, value in blocks.items():
        entry = RECOGNISED_FEATURES[key]
        where = key_path(path, key)
        if entry.ignored:
            logger.info(
                "%s: a legacy DeepSpeed key, accepted and ignored (as DeepSpeed does)", where
            )
        if not entry.is_active(value, where):
            continue
        if entry.provider is None:
            raise ConfigError(f"{where} = {show_value(value)}: {entry.replacement}", where)
        first_active = first_active or where
        active.append(
            f"{where} = {show_value(value)} asks for {entry.feature}, which will come with "
            f"{entry.provider} (accepted meanwhile: {entry.inert})"
        )
    if active:
        noun = "this key is" if len(active) == 1 else "these keys are"
        raise NotImplementedFeatureError(
            f"{noun} recognised but not implemented yet in this release of Slipstream: "
            + "; ".join(active)
            + ". Remove them or set them to the accepted inert value.",
            first_active,
        )
    return {key: value for key, value in blocks.items()}
