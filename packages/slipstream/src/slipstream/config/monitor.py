"""The monitor blocks ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet`` (DeepSpeed's keys)."""

from __future__ import annotations

import dataclasses

from slipstream.kernels.config_schema import ConfigBlock, config_fail, key_path

__all__ = ["CometConfig", "CsvMonitorConfig", "TensorBoardConfig", "WandbConfig"]

_DEFAULT_JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default, kept so paths match its runs
_COMET_MODES = ("get", "create", "get_or_create")


@dataclasses.dataclass(kw_only=True)
class TensorBoardConfig(ConfigBlock):
    """``"tensorboard": {...}``: scalar events for TensorBoard (needs the ``tensorboard`` package).

    Attributes:
        enabled: write events (rank 0 only).
        output_path: the folder holding the job's folder; empty means the working directory.
        job_name: the event files go to ``output_path/job_name``.
    """

    enabled: bool = False
    output_path: str = ""
    job_name: str = _DEFAULT_JOB_NAME


@dataclasses.dataclass(kw_only=True)
class CsvMonitorConfig(ConfigBlock):
    """``"csv_monitor": {...}``: one CSV file per event name under ``output_path/job_name``.

    Attributes:
        enabled: write the files (rank 0 only).
        output_path: the folder holding the job's folder; empty means the working directory.
        job_name: the folder the CSV files go to, inside ``output_path``.
    """

    enabled: bool = False
    output_path: str = ""
    job_name: str = _DEFAULT_JOB_NAME


@dataclasses.dataclass(kw_only=True)
class WandbConfig(ConfigBlock):
    """``"wandb": {...}``: log events to Weights & Biases (needs the ``wandb`` package).

    Attributes:
        enabled: start a run on rank 0 and log every event to it.
        group: the run group (``wandb.init(group=...)``); null for none.
        team: the entity (team or user) owning the project; null for wandb's default.
        project: the project name.
    """

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclasses.dataclass(kw_only=True)
class CometConfig(ConfigBlock):
    """``"comet": {...}``: log events to a Comet experiment (needs ``comet_ml>=3.41``).

    Null values are left to Comet's own configuration (``.comet.config`` or ``COMET_*``
    environment variables), as ``comet_ml.start`` reads them.

    Attributes:
        enabled: start an experiment on rank 0 and log events to it.
        samples_log_interval: log an event name again only once this many samples have passed
            since it was last logged.
        project, workspace, api_key: where to log, and the credentials.
        experiment_name: a display name set on the experiment.
        experiment_key: an existing experiment's key (32-50 alphanumeric characters).
        online: false keeps the experiment offline (stored locally).
        mode: ``"get"``, ``"create"`` or ``"get_or_create"`` (Comet's default).
    """

    enabled: bool = False
    samples_log_interval: int = dataclasses.field(default=100, metadata={"ge": 0})
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None

    def validate(self, path: str) -> None:
        """``mode`` is one of Comet's three start modes."""
        if self.mode is not None and self.mode not in _COMET_MODES:
            config_fail(key_path(path, "mode"), self.mode, " or ".join(map(repr, _COMET_MODES)))
