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

Each kernel has the same shape: :func:`program_block` reads the program's table entry,
:func:`block_pointers` turns addresses into the block's pointers (with a 16-byte alignment hint
when the host found every address aligned: ``ALIGNED``), and the kernel calls its optimizer's
block function unmasked for a full block or masked (``MASKED``) for a tensor's last, partial
one; the block function reads and writes through :func:`load_block` / :func:`store_block`, so
full blocks move 16 bytes per thread per access. :meth:`Group.launch` passes the arguments in
the order these kernels take them, and :func:`aot_specs` builds their AOT signatures.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, check_kernel_device

# Elements per program and warps, shared by the three optimizers: 1024 fp32 over 4 warps is 8
# elements (two 16-byte accesses) per thread per tensor, and the per-program table lookups
# (tensor, start, addresses) are paid once per 1024 elements. Measured by CUDA events on 200M
# fp32 params in 56 tensors, fraction of device copy bandwidth: on an H200, 1024 x 4 ran Adam /
# Lion / LAMB at 97.0 / 96.7 / 96.2%, 1024 x 8 at 97.3 / 97.0 / 95.5%, 2048 x 4 at 92.8 /
# 93.4 / 87.6%, 2048 x 8 at 91.8 / 93.7 / 93.1%, 4096 and 8192 at 71-94% (the old always-masked,
# unhinted 1024-element kernels: Lion 84%, LAMB 82%). On an H100, Adam ran at 94-99% with
# 1024-8192 elements and 4-16 warps once its accesses were 16 bytes wide.
BLOCK = 1024
WARPS = 4
_BLOCK_TABLES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_CACHED_TABLES = 64


@triton.jit
def program_block(numels, block_tensor, block_start, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """This program's table entry: ``(tensor, start, offsets, remaining)``.

    ``tensor`` indexes the address tables, ``start`` is the block's first element (int64, added
    to the base pointer once), ``offsets`` are ``0..BLOCK`` (int32), ``remaining`` the elements
    of the tensor from ``start`` on: the block is full when ``remaining >= BLOCK``.
    """
    pid = tl.program_id(0)
    tensor = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    if ALIGNED:
        start = tl.multiple_of(start, 16)  # blocks start at multiples of BLOCK >= 16 elements
    remaining = tl.load(numels + tensor) - start
    return tensor, start, tl.arange(0, BLOCK), remaining


@triton.jit
def block_pointers(table_ptr, example_ptr, tensor, start, offsets, ALIGNED: tl.constexpr):
    """Pointers to the block's elements of entry ``tensor`` of an address table.

    The address is typed like ``example_ptr`` (``int64 -> pointer``). An address loaded from a
    table has unknown alignment, so without a hint Triton issues one 4-byte access per element;
    with ``ALIGNED`` (checked on the host) each thread moves 16 bytes per instruction.
    """
    base = tl.load(table_ptr + tensor).to(tl.pointer_type(example_ptr.dtype.element_ty))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base + start + offsets


@triton.jit
def load_block(pointers, mask, MASKED: tl.constexpr):
    """A block as fp32: masked (``other=0``) for a tensor's last block, else unmasked.

    Full blocks are unmasked because a mask whose bound has unknown alignment would stop the
    compiler from using 16-byte accesses; they are streamed, read once, so ``evict_first``
    keeps them from crowding L2.
    """
    if MASKED:
        values = tl.load(pointers, mask=mask, other=0.0)
    else:
        values = tl.load(pointers, eviction_policy="evict_first")
    return values.to(tl.float32)


@triton.jit
def store_block(pointers, values, mask, MASKED: tl.constexpr):
    """Round ``values`` once to the pointers' dtype and store them (``mask`` if ``MASKED``)."""
    if MASKED:
        tl.store(pointers, values.to(pointers.dtype.element_ty), mask=mask)
    else:
        tl.store(pointers, values.to(pointers.dtype.element_ty))


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
        self.block = block

    def launch(
        self,
        kernel: Any,
        tables: Sequence[int],
        examples: Sequence[int],
        *args: Any,
        warps: int = WARPS,
        **constexprs: Any,
    ) -> None:
        """One launch of ``kernel`` over every block of the group.

        The kernel takes the address tables of the lists ``tables``, the index tables
        (``numels, block_tensor, block_start``), one example tensor (for its pointer type) from
        each list of ``examples``, then ``args``, its own ``constexprs``, ``ALIGNED`` and
        ``BLOCK``, in that order (as :func:`aot_specs` builds its signatures).
        """
        kernel[(self.programs,)](
            *(self.tables[i] for i in tables),
            self.numel_table,
            self.block_tensor,
            self.block_start,
            *(self.lists[i][0] for i in examples),
            *args,
            **constexprs,
            ALIGNED=self.aligned,
            BLOCK=self.block,
            num_warps=warps,
        )


def groups(
    op: str,
    lists: Sequence[Sequence[torch.Tensor]],
    block: int = BLOCK,
    *,
    states_from: int | None = None,
) -> list[Group]:
    """Check the parallel tensor ``lists`` (params, grads, states...) and group them by dtypes.

    Raises ValueError for unequal lengths, mismatched shapes, non-contiguous tensors or tensors
    on different devices, and, with ``states_from``, unless the lists from that one on (the
    states, read through one pointer type) share a dtype in each group; empty tensors are left
    out.
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
    if states_from is not None:
        for key in by_dtypes:
            if len(set(key[states_from:])) > 1:
                raise ValueError(
                    f"{op} (triton): the optimizer states of one tensor must share a dtype, got "
                    f"{sorted(map(str, set(key[states_from:])))}"
                )
    return [Group(indices, lists, block) for indices in by_dtypes.values()]


# The (param, grad, state) dtype combinations compiled ahead of time: fp32 training, bf16
# params and grads with fp32 states, and fp32 grads of fp16 params (fp16 mixed precision).
AOT_DTYPES = (("fp32", "fp32", "fp32"), ("bf16", "bf16", "fp32"), ("fp16", "fp32", "fp32"))
_INDEX_TABLE_SIGNATURE = {"numels": "*i64", "block_tensor": "*i32", "block_start": "*i64"}


def fp32_scalars(*names: str) -> dict[str, str]:
    """AOT signature entries for fp32 scalar arguments."""
    return {name: "fp32" for name in names}


def aot_specs(
    name: str,
    kernel: Any,
    tables: Sequence[str],
    examples: Sequence[str],
    args: Mapping[str, str],
    variants: Sequence[Mapping[str, Any]] = ({},),
    block: int = BLOCK,
) -> Iterator[AotSpec]:
    """The AOT specialisations of a kernel launched by :meth:`Group.launch`.

    ``tables`` name its address-table arguments, ``examples`` its example-pointer arguments
    (each ``"param_example"``, ``"grad_example"`` or ``"state_example"``, typed from
    :data:`AOT_DTYPES`), ``args`` the rest of its runtime arguments with their types;
    ``variants`` give values of its own constexprs, each combined with every dtype triple.
    The aligned path is the one compiled: it is what fresh allocations take.
    """
    for dtypes in AOT_DTYPES:
        dtype_of = dict(zip(("param", "grad", "state"), dtypes))
        tag = f"[{','.join(dtypes)}]"
        for constexprs in variants:
            flags = "".join(f"[{key.lower()}={value}]" for key, value in constexprs.items())
            signature = {
                **{table: "*i64" for table in tables},
                **_INDEX_TABLE_SIGNATURE,
                **{example: f"*{dtype_of[example.split('_')[0]]}" for example in examples},
                **args,
                **{key: "constexpr" for key in constexprs},
                "ALIGNED": "constexpr",
                "BLOCK": "constexpr",
            }
            values = {**constexprs, "ALIGNED": True, "BLOCK": block}
            yield AotSpec(f"{name}{tag}{flags}", kernel, signature, values)
