"""The ``comms_logger`` config block (DeepSpeed's keys and defaults)."""

from __future__ import annotations

import dataclasses

from slipstream.kernels.config_schema import ConfigBlock

__all__ = ["CommsLoggerConfig", "TensorParallelConfig"]


@dataclasses.dataclass(kw_only=True)
class CommsLoggerConfig(ConfigBlock):
    """Settings of the communication logger (``"comms_logger": {...}`` in the config).

    Attributes:
        enabled: record collectives at all. Off, a collective costs one boolean check more
            than calling torch.distributed directly.
        verbose: also log every recorded op as it completes (rank 0).
        prof_all: record every op; when False, only the ops named in `prof_ops` (and calls
            made with ``prof=True``).
        debug: key each record by the calling function too (``all_reduce | [caller: step]``).
        prof_ops: op names (or ``log_name`` values) to record when `prof_all` is False.

    Unlike DeepSpeed, where the block's presence alone switches logging on, `enabled` is
    honoured as written.
    """

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class TensorParallelConfig(ConfigBlock):
    """Tensor parallelism for training (``"tensor_parallel": {...}``, DeepSpeed's AutoTP key).

    Attributes:
        autotp_size: the tensor-parallel degree. Above 1, ``slipstream.initialize`` shards a
            supported Hugging Face decoder over groups of that many adjacent ranks (see
            docs/tensor-parallel.md) and the data-parallel size becomes
            ``world_size / autotp_size``. 0 or 1: no tensor parallelism.
    """

    autotp_size: int = dataclasses.field(default=0, metadata={"ge": 0})
