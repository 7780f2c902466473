"""Settings of the asynchronous I/O engine: the DeepSpeed ``"aio"`` config block.

The field names and defaults follow DeepSpeed's ``aio`` section, so an existing ZeRO-Infinity
config works unchanged; ``o_direct`` is a Slipstream addition (DeepSpeed always uses O_DIRECT),
to allow swap on file systems without direct I/O (tmpfs, some network mounts) at the cost of the
page cache. Values are checked when the settings are built, not when the first swap happens
minutes into a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ALIGNMENT", "AioSettings"]

ALIGNMENT = 4096  # O_DIRECT alignment of buffer addresses, sizes and file offsets
_ALIASES = {"thread_count": "intra_op_parallelism"}  # older DeepSpeed name of the same knob


@dataclass(frozen=True, kw_only=True, slots=True)
class AioSettings:
    """How transfers are cut up and issued (DeepSpeed's ``"aio"`` block).

    Attributes:
        block_size: Bytes per I/O request a large transfer is cut into; a multiple of 4096
            when ``o_direct`` (O_DIRECT needs aligned sizes).
        queue_depth: Requests in flight per thread (kernel AIO slots per thread; the
            thread-pool modes run ``intra_op_parallelism × queue_depth`` blocking workers).
        intra_op_parallelism: Threads that split one large transfer (alias ``thread_count``).
        single_submit: Submit requests one ``io_submit`` at a time instead of in batches
            (kernel AIO only; the thread pools hand requests over one by one anyway).
        overlap_events: Refill free slots as completions are reaped, instead of waiting for a
            whole batch to finish (kernel AIO only; the thread pools always overlap).
        use_gds: GPUDirect Storage; not supported, so ``True`` is refused.
        o_direct: Open swap files with O_DIRECT (bypassing the page cache).
        verify_checksums: Check every swap payload read against the checksum recorded when it
            was written (xxh3_64); a mismatch raises SwapFileCorruptError. A Slipstream
            addition; false saves the hashing (about 26 GB/s per core) at the price of
            training on whatever the drive returns.
        kernel_aio: With ``o_direct``, the C++ backend issues Linux kernel AIO (falling back
            to its thread pool when ``io_setup`` fails); False uses the thread pool of
            blocking pread/pwrite calls always (a Slipstream addition, for comparing them).
    """

    block_size: int = 1048576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    o_direct: bool = True
    verify_checksums: bool = True
    kernel_aio: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{name} must be a positive integer, got {value!r}")
        for name in (
            "single_submit",
            "overlap_events",
            "use_gds",
            "o_direct",
            "verify_checksums",
            "kernel_aio",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"aio.{name} must be true or false, got {value!r}")
        if self.use_gds:
            raise NotImplementedError(
                "aio.use_gds=true (GPUDirect Storage) is not supported by Slipstream; remove "
                "the key or set it to false (swap goes through pinned host memory)"
            )
        if self.o_direct and self.block_size % ALIGNMENT != 0:
            raise ValueError(
                f"aio.block_size must be a multiple of {ALIGNMENT} with o_direct, got "
                f"{self.block_size}; use e.g. 1048576, or set o_direct to false"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AioSettings:
        """Settings from a DeepSpeed ``"aio"`` block (``None`` or ``{}`` gives the defaults).

        Raises:
            ValueError: An unknown key (named, with the valid keys listed), a key given twice
                through its alias, or an invalid value.
        """
        if data is None:
            return cls()
        valid = [f.name for f in fields(cls)]
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = _ALIASES.get(key, key)
            if name not in valid:
                raise ValueError(
                    f"unknown aio setting {key!r}; valid keys: {', '.join(valid)} "
                    f"(and the alias {', '.join(_ALIASES)})"
                )
            if name in values:
                raise ValueError(f"aio setting {name!r} is given twice (through alias {key!r})")
            values[name] = value
        return cls(**values)
