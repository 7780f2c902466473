"""The ``checkpoint`` block: DeepSpeed's checkpoint keys plus what Slipstream verifies."""

from __future__ import annotations

import dataclasses

from slipstream.kernels.config_schema import ConfigBlock, key_path, not_implemented

__all__ = ["CheckpointConfig", "ParallelWriteConfig"]

_LATER = "a later release of the slipstream package"


@dataclasses.dataclass(kw_only=True)
class ParallelWriteConfig(ConfigBlock):
    """``checkpoint.parallel_write`` (DeepSpeed): per-pipeline-stage writers; not implemented."""

    pipeline_stage: bool = False


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig(ConfigBlock):
    """``"checkpoint": {...}``: how engine checkpoints are written and checked (docs/reliability.md).

    Attributes:
        verify_checksums: check every checkpoint file against the checksum its manifest records
            before anything is loaded (a Slipstream key; default true). False skips reading
            each file once more, for very large checkpoints on slow file systems; sizes,
            names, shapes and dtypes are still checked.
        allow_non_finite: let ``save_checkpoint`` write weights or optimizer state that hold
            NaN or inf (a Slipstream key; default false: such a save raises
            NonFiniteCheckpointError and ``latest`` keeps naming the last good checkpoint).
            ``save_checkpoint(..., allow_non_finite=True)`` does the same for one save.
        tag_validation: DeepSpeed's check that every rank saves the same tag; Slipstream's
            rank-0-chosen, broadcast tag makes it moot: only ``"Warn"`` (any case) is accepted.
        load_universal, use_node_local_storage, parallel_write: DeepSpeed features not
            implemented here; only their defaults (false) are accepted.
    """

    verify_checksums: bool = True
    allow_non_finite: bool = False
    tag_validation: str = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = dataclasses.field(default_factory=ParallelWriteConfig)

    def validate(self, path: str) -> None:
        """The DeepSpeed keys are accepted at their defaults only."""
        if self.tag_validation.lower() != "warn":
            not_implemented(
                key_path(path, "tag_validation"),
                self.tag_validation,
                "DeepSpeed's tag validation modes",
                _LATER,
                'Remove it or write "Warn": every rank already saves the tag rank 0 chose.',
            )
        for name, feature in (
            ("load_universal", "loading DeepSpeed universal checkpoints"),
            ("use_node_local_storage", "checkpoints on node-local storage"),
        ):
            if getattr(self, name):
                not_implemented(
                    key_path(path, name), True, feature, _LATER, "Remove it or set it to false."
                )
        if self.parallel_write.pipeline_stage:
            not_implemented(
                key_path(key_path(path, "parallel_write"), "pipeline_stage"),
                True,
                "per-pipeline-stage checkpoint writers",
                _LATER,
                "Remove it or set it to false.",
            )
