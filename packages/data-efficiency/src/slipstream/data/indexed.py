"""Memory-mapped index files in DeepSpeed/Megatron's ``MMIDIDX`` format (``.idx`` + ``.bin``).

Each file pair holds rows of integers of one dtype: ``<prefix>.bin`` the values back to back,
``<prefix>.idx`` a header (magic, version 1, dtype code, row count, document count), the row
sizes (int32), the byte offsets of the rows (int64) and a document index (int64). Files written
here are read by DeepSpeed's ``MMapIndexedDataset`` and the other way round.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["IndexedRows", "IndexedRowsWriter", "fit_int_dtype", "write_rows"]

_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES: dict[int, type[np.integer]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.uint16,
    7: np.uint32,
    8: np.uint64,
}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def fit_int_dtype(low: int, high: int) -> np.dtype:
    """The smallest integer dtype of the format holding every value in ``[low, high]``."""
    for candidate in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.int64):
        info = np.iinfo(candidate)
        if info.min <= low and high <= info.max:
            return np.dtype(candidate)
    return np.dtype(np.uint64)


class IndexedRowsWriter:
    """Appends integer rows to ``<prefix>.bin``; ``close()`` writes ``<prefix>.idx``.

    Both files are written under temporary names and renamed on close, so a crash never
    leaves a half-written pair under the final name.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(
                f"index files hold integers; dtype {self.dtype} is not one of "
                f"{sorted(str(d) for d in _CODES)}"
            )
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._data = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []

    def add_row(self, values: Iterable[int] | np.ndarray) -> None:
        """Append one row."""
        array = np.asarray(values, dtype=self.dtype).reshape(-1)
        self._data.write(array.tobytes(order="C"))
        self._sizes.append(int(array.size))

    def close(self) -> None:
        """Write the index and move both files into place."""
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        with open(idx_tmp, "wb") as stream:
            stream.write(_MAGIC)
            stream.write(struct.pack("<Q", 1))
            stream.write(struct.pack("<B", _CODES[self.dtype]))
            stream.write(struct.pack("<Q", len(sizes)))
            stream.write(struct.pack("<Q", len(doc_idx)))
            stream.write(sizes.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(doc_idx.tobytes(order="C"))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")


def write_rows(
    prefix: str | os.PathLike[str], rows: Iterable[np.ndarray], dtype: np.dtype | type
) -> None:
    """Write ``rows`` as one index file pair."""
    writer = IndexedRowsWriter(prefix, dtype)
    for row in rows:
        writer.add_row(row)
    writer.close()


class IndexedRows:
    """Read-only, memory-mapped rows of an index file pair: ``rows[i]`` is a NumPy view.

    >>> rows = IndexedRows("analysis/seqlen/seqlen_index_to_sample")   # doctest: +SKIP
    >>> len(rows), rows[0][:5]                                         # doctest: +SKIP
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = str(prefix)
        index_path = f"{self.prefix}.idx"
        if not os.path.isfile(index_path) or not os.path.isfile(f"{self.prefix}.bin"):
            raise FileNotFoundError(
                f"index files {self.prefix}.idx/.bin not found; write them with "
                "slipstream.data.DataAnalyzer (or DeepSpeed's DataAnalyzer)"
            )
        with open(index_path, "rb") as stream:
            magic = stream.read(9)
            if magic != _MAGIC:
                raise ValueError(f"{index_path} is not an MMIDIDX index file (magic {magic!r})")
            (version,) = struct.unpack("<Q", stream.read(8))
            if version != 1:
                raise ValueError(f"{index_path}: index format version {version} is not supported")
            (code,) = struct.unpack("<B", stream.read(1))
            if code not in _DTYPES:
                raise ValueError(f"{index_path}: unknown dtype code {code}")
            self.dtype = np.dtype(_DTYPES[code])
            (count,) = struct.unpack("<Q", stream.read(8))
            (doc_count,) = struct.unpack("<Q", stream.read(8))
            offset = stream.tell()
        index = np.memmap(index_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=offset)
        self.pointers = np.frombuffer(
            index, dtype=np.int64, count=count, offset=offset + self.sizes.nbytes
        )
        self._data = (
            np.memmap(f"{self.prefix}.bin", mode="r", dtype=self.dtype)
            if os.path.getsize(f"{self.prefix}.bin")
            else np.zeros(0, dtype=self.dtype)
        )
        del doc_count

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def __getitem__(self, row: int) -> np.ndarray:
        start = int(self.pointers[row]) // self.dtype.itemsize
        return self._data[start : start + int(self.sizes[row])]

    def concatenated(self) -> np.ndarray:
        """Every row back to back (one read of the whole data file)."""
        return np.asarray(self._data)
