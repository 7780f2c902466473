"""Shared machinery of the multi-tensor Triton optimizer kernels (Adam/AdamW, Lion, LAMB).

[Note: multi-tensor launches]
A model has hundreds of parameter tensors, many tiny (biases, norms). Launching one kernel per
tensor costs more than the update itself, so, as DeepSpeed's ``multi_tensor_apply`` does, each
launch covers a whole group of tensors: the host builds tables of the tensors' addresses and
sizes plus a (tensor, block start) entry per program, and each program turns its table entry
back into a typed pointer (``int64 -> pointer``) and updates one block of one tensor. Tensors
are grouped by their dtypes (param, grad, state), since pointer types are compile-time in
Triton. The block table depends only on the tensor sizes and is cached; the address tables (one
host-to-device copy) are cached by the addresses themselves and rebuilt whenever one changes
(gradients are often re-allocated by ``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import check_kernel_device

BLOCK = 1024
_BLOCK_TABLES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_CACHED_TABLES = 64


@triton.jit
def block_pointers(table_ptr, example_ptr, tensor):
    """Entry ``tensor`` of an address table as a pointer typed like ``example_ptr``."""
    address = tl.load(table_ptr + tensor)
    return address.to(tl.pointer_type(example_ptr.dtype.element_ty))


@triton.jit
def aligned_block_pointers(table_ptr, example_ptr, tensor, ALIGNED: tl.constexpr):
    """:func:`block_pointers`, with a 16-byte alignment hint when the host checked it.

    An address loaded from a table has unknown alignment, so without the hint Triton issues one
    4-byte access per element; with it, each thread moves 16 bytes per instruction.
    """
    pointer = tl.load(table_ptr + tensor).to(tl.pointer_type(example_ptr.dtype.element_ty))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


_ADDRESS_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}
_MAX_CACHED_ADDRESS_TABLES = 16


class Group:
    """Tensors of one dtype combination, with the tables a multi-tensor launch reads."""

    def __init__(
        self, indices: list[int], lists: Sequence[Sequence[torch.Tensor]], block: int = BLOCK
    ) -> None:
        self.indices = indices
        self.lists = [[tensors[i] for i in indices] for tensors in lists]
        device = self.lists[0][0].device
        numels = tuple(t.numel() for t in self.lists[0])
        self.numels = numels
        addresses = [[t.data_ptr() for t in tensors] for tensors in self.lists]
        # Every address 16-byte aligned (fresh allocations are; views into flat buffers may not
        # be): the kernels may then use 16-byte accesses.
        self.aligned = all(a % 16 == 0 for column in addresses for a in column)
        # The address tables and the sizes travel in one host-to-device copy, and are reused
        # while the tensors stay where they are (the usual case from one step to the next): a
        # table holds only these addresses, so a cached one is right whenever they match.
        key = (device, numels, *(tuple(column) for column in addresses))
        packed = _ADDRESS_TABLES.get(key)
        if packed is None:
            flat = [a for column in addresses for a in column] + list(numels)
            packed = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
            if len(_ADDRESS_TABLES) >= _MAX_CACHED_ADDRESS_TABLES:
                _ADDRESS_TABLES.clear()
            _ADDRESS_TABLES[key] = packed
        count = len(numels)
        self.tables = [packed[i * count : (i + 1) * count] for i in range(len(self.lists))]
        self.numel_table = packed[len(self.lists) * count :]
        block_key = (device, numels, block)
        cached = _BLOCK_TABLES.get(block_key)
        if cached is None:
            counts = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64)
            block_tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
            firsts = torch.cumsum(counts, 0) - counts
            block_index = torch.arange(int(counts.sum())) - firsts[block_tensor]
            cached = (
                block_tensor.to(torch.int32).to(device),
                (block_index * block).to(torch.int64).to(device),
            )
            if len(_BLOCK_TABLES) >= _MAX_CACHED_TABLES:
                _BLOCK_TABLES.clear()
            _BLOCK_TABLES[block_key] = cached
        self.block_tensor, self.block_start = cached
        self.programs = int(self.block_tensor.numel())


def groups(op: str, lists: Sequence[Sequence[torch.Tensor]], block: int = BLOCK) -> list[Group]:
    """Check the parallel tensor ``lists`` (params, grads, states...) and group them by dtypes.

    Raises ValueError for unequal lengths, mismatched shapes, non-contiguous tensors or tensors
    on different devices; empty tensors are left out.
    """
    count = len(lists[0])
    for tensors in lists[1:]:
        if len(tensors) != count:
            raise ValueError(f"{op}: every tensor list must have the same length ({count})")
    # One device check over every tensor, and a tight per-tensor loop below: this runs on the
    # host before every launch, and with hundreds of tensors its Python cost is a visible part
    # of an optimizer step that takes a few milliseconds on the GPU.
    indices = {t.get_device() for tensors in lists for t in tensors}  # ints: cheaper than .device
    if len(indices) != 1 or -1 in indices:  # several devices, or CPU: the full check and message
        check_kernel_device(op, *(t for tensors in lists for t in tensors))
    by_dtypes: dict[tuple[torch.dtype, ...], list[int]] = {}
    for index, column in enumerate(zip(*lists)):
        shape = column[0].shape
        for tensor in column:
            if tensor.shape != shape:
                shapes = {tuple(t.shape) for t in column}
                raise ValueError(f"{op}: tensor {index} has mismatched shapes {sorted(shapes)}")
        if column[0].numel() == 0:
            continue
        for tensor in column:
            if not tensor.is_contiguous():
                raise ValueError(
                    f"{op} (triton): tensor {index} is not contiguous; the multi-tensor kernel "
                    "addresses each tensor as one flat buffer. Make parameters, gradients and "
                    "states contiguous, or force the reference backend"
                )
        # Pointer types are compile-time: one launch per combination of (param, grad, state)
        # dtypes, since grads and states may differ from their params (fp32 grads of bf16).
        key = tuple([t.dtype for t in column])
        by_dtypes.setdefault(key, []).append(index)
    return [Group(indices, lists, block) for indices in by_dtypes.values()]


def check_states_share_dtype(op: str, group: Group, first_state: int) -> None:
    """Raise ValueError unless the lists from ``first_state`` on have one dtype (one pointer type)."""
    dtypes = {tensors[0].dtype for tensors in group.lists[first_state:]}
    if len(dtypes) > 1:
        raise ValueError(
            f"{op} (triton): the optimizer states of one tensor must share a dtype, got "
            f"{sorted(map(str, dtypes))}"
        )


def table_signature(names: Sequence[str]) -> dict[str, str]:
    """AOT signature entries for address tables (``int64`` arrays of data pointers)."""
    return {name: "*i64" for name in names}


INDEX_TABLE_SIGNATURE = {"numels": "*i64", "block_tensor": "*i32", "block_start": "*i64"}
