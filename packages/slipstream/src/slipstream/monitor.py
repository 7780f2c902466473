"""Training monitors: rank 0 writes ``(name, value, samples)`` events to CSV, TensorBoard, W&B, Comet.

The engine writes DeepSpeed's events (``Train/Samples/train_loss``, ``Train/Samples/lr``,
``Train/Samples/loss_scale``, ...) against the number of samples trained so far; users add
their own through ``engine.monitor.write_events``:

>>> engine.monitor.write_events([("Eval/Samples/accuracy", 0.91, engine.global_samples)])  # doctest: +SKIP

Each backend's library is imported only when its block is enabled, on rank 0.
"""

from __future__ import annotations

import csv
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from slipstream import comm
from slipstream.config.monitor import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig

if TYPE_CHECKING:
    from slipstream.config import SlipstreamConfig

__all__ = [
    "CometMonitor",
    "CsvMonitor",
    "Event",
    "MonitorBackend",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
]

logger = logging.getLogger(__name__)

Event = tuple[str, Any, int]
"""``(name, value, step)``: the engine's step is the global sample count, as in DeepSpeed."""


class MonitorBackend(Protocol):
    """One destination for events."""

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def close(self) -> None:
        """Flush and release the destination."""


def _import_backend(module: str, key: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f'"{key}": {{"enabled": true}} needs the {pip_name!r} package, which is not '
            f"installed: pip install {pip_name} (or the slipstream[{key}] extra), "
            f"or set {key}.enabled to false"
        ) from error


def _log_dir(output_path: str, job_name: str) -> str:
    # DeepSpeed's layout: output_path/job_name, relative to the working directory when
    # output_path is empty (its default).
    log_dir = os.path.join(output_path, job_name)
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


class CsvMonitor:
    """DeepSpeed's ``csv_monitor`` layout: ``output_path/job_name/<name>.csv`` per event name.

    The file name is the event name with ``/`` and spaces replaced by ``_``
    (``Train_Samples_train_loss.csv``); its rows are ``step,value`` under a header
    ``step,<last part of the name>`` written the first time this monitor writes that name.
    Files are appended to, so a resumed run continues them (with a repeated header).
    """

    def __init__(self, config: CsvMonitorConfig) -> None:
        self.log_dir = _log_dir(config.output_path, config.job_name)
        self._started: set[str] = set()

    def write_events(self, events: Sequence[Event]) -> None:
        """Append one row per event to its name's file."""
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a", newline="") as file:
                writer = csv.writer(file)
                if filename not in self._started:
                    self._started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        """Nothing is held open between writes."""


class TensorBoardMonitor:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``."""

    def __init__(self, config: TensorBoardConfig) -> None:
        # torch.utils.tensorboard imports the `tensorboard` package; check it first so the
        # error names what to install.
        _import_backend("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _log_dir(config.output_path, config.job_name)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        """``add_scalar(name, value, step)`` for each event, then flush (as DeepSpeed does)."""
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.summary_writer.close()


class WandbMonitor:
    """A Weights & Biases run: ``wandb.init(project, group, entity=team)``, one ``log`` per event."""

    def __init__(self, config: WandbConfig) -> None:
        self._wandb = _import_backend("wandb", "wandb", "wandb")
        self.run = self._wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Sequence[Event]) -> None:
        """``wandb.log({name: value}, step=step)`` for each event."""
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        """Finish the run."""
        self._wandb.finish()


class CometMonitor:
    """A Comet experiment from ``comet_ml.start(...)``; each event name is logged at most once
    per ``samples_log_interval`` samples (the first occurrence always)."""

    def __init__(self, config: CometConfig) -> None:
        comet_ml = _import_backend("comet_ml", "comet", "comet_ml")
        version = tuple(int(part) for part in comet_ml.__version__.split(".")[:2] if part.isdigit())
        if version < (3, 41):
            raise ImportError(
                f'"comet": {{"enabled": true}} needs comet_ml >= 3.41 (for comet_ml.start), '
                f'found {comet_ml.__version__}: pip install "comet_ml>=3.41"'
            )
        self.samples_log_interval = config.samples_log_interval
        self._last_logged: dict[str, int] = {}
        self.experiment = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)

    def write_events(self, events: Sequence[Event]) -> None:
        """``experiment.log_metric(name, value, step=step)`` for the events that are due."""
        for name, value, step in events:
            last = self._last_logged.get(name)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self._last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        """End the experiment (uploads or writes the offline archive)."""
        self.experiment.end()


class MonitorMaster:
    """Fans events out to every enabled monitor, on global rank 0 only (as DeepSpeed does).

    ``enabled`` is true on every rank when any block is enabled (so callers can skip building
    events); only rank 0 creates the backends, and ``write_events`` is a no-op elsewhere.
    """

    def __init__(
        self,
        *,
        tensorboard: TensorBoardConfig | None = None,
        wandb: WandbConfig | None = None,
        csv_monitor: CsvMonitorConfig | None = None,
        comet: CometConfig | None = None,
        rank: int | None = None,
    ) -> None:
        self.rank = rank if rank is not None else comm.get_rank()
        self.backends: list[MonitorBackend] = []
        blocks: list[tuple[Any, Callable[[Any], MonitorBackend]]] = [
            (tensorboard, TensorBoardMonitor),
            (wandb, WandbMonitor),
            (csv_monitor, CsvMonitor),
            (comet, CometMonitor),
        ]
        self.enabled = any(block is not None and block.enabled for block, _ in blocks)
        if self.rank == 0:
            for block, backend in blocks:
                if block is not None and block.enabled:
                    self.backends.append(backend(block))
            if self.backends:
                logger.info("monitoring to %s", ", ".join(type(b).__name__ for b in self.backends))

    @classmethod
    def from_config(cls, config: SlipstreamConfig, rank: int | None = None) -> MonitorMaster:
        """The monitors of a config's four blocks."""
        return cls(
            tensorboard=config.tensorboard,
            wandb=config.wandb,
            csv_monitor=config.csv_monitor,
            comet=config.comet,
            rank=rank,
        )

    def write_events(self, events: Sequence[Event]) -> None:
        """Write ``(name, value, step)`` events to every monitor (rank 0; no-op elsewhere)."""
        for backend in self.backends:
            backend.write_events(events)

    def close(self) -> None:
        """Flush and close every monitor."""
        for backend in self.backends:
            backend.close()
        self.backends = []
