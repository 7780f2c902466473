"""The tensor-parallel sum of the fused decoder: NCCL/gloo, or a one-shot all-reduce over NVLink P2P.

A decode step of a tensor-parallel decoder sums two small partial outputs per block (8 KB per
token row for a 4096-wide bf16 model): NCCL's launch and protocol latency dominates such
messages. ``tensor_parallel.allreduce`` picks how they are summed:

- ``"nccl"``: ``torch.distributed.all_reduce`` on the group (NCCL on GPUs, gloo on CPUs).
- ``"symm_mem"``: PyTorch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem``): each
  rank copies its partial sum into a buffer every rank of the group has mapped, and one kernel
  reads the peers' buffers over NVLink peer-to-peer loads and adds them (no multicast needed).
  Messages larger than ``tensor_parallel.symm_mem_bytes`` and dtypes the kernel lacks (fp16)
  still go through NCCL. Needs CUDA tensors and an NCCL group; refused otherwise.
- ``"symm_mem_or_nccl"``: ``symm_mem`` where it can run (checked once, with a test sum every rank must
  pass), else ``nccl``.

On the symmetric-memory path, ``tensor_parallel.symm_mem_kernel`` picks the kernel of the small
sums: ``"slipstream"`` (default) is :mod:`slipstream.inference.allreduce_norm`'s Triton kernel,
one one-way crossing of NVLink per sum instead of the barriers and loads of torch's one-shot
kernel, and it also runs a block's sum, residual add and RMSNorm as one kernel
(:meth:`TPReducer.add_rms_norm`); ``"torch"`` keeps ``torch.ops.symm_mem``'s kernel and the
separate ``add_rms_norm``. The Slipstream kernel is checked once at setup against its torch
reference on every rank; if it fails anywhere, torch's kernel is used (logged).

All of them are captured in the CUDA graph of the decode step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from slipstream.inference.allreduce_norm import (
    MAX_BLOCKS,
    MAX_SPIN,
    SymmNormState,
    all_reduce_sum,
    reduce_add_rms_norm,
    reference,
    reference_sum,
)
from slipstream.kernels.ops import add_rms_norm

__all__ = ["ALLREDUCE_MODES", "SYMM_MEM_KERNELS", "TPReducer", "install_reducer"]

logger = logging.getLogger(__name__)

ALLREDUCE_MODES = ("symm_mem_or_nccl", "nccl", "symm_mem")
SYMM_MEM_KERNELS = ("slipstream", "torch")
_SYMM_DTYPES = (torch.bfloat16, torch.float32)  # the one-shot kernel's dtypes


def _symm_ops() -> tuple[Any, Any] | None:
    """``(one_shot_all_reduce_copy_out or None, one_shot_all_reduce_out)``, or None."""
    try:
        import torch.distributed._symmetric_memory  # registers torch.ops.symm_mem

        ops = torch.ops.symm_mem
        plain = ops.one_shot_all_reduce_out
    except (ImportError, AttributeError, RuntimeError):
        return None
    try:
        fused = ops.one_shot_all_reduce_copy_out
    except (AttributeError, RuntimeError):
        fused = None
    return fused, plain


class TPReducer:
    """Sums a tensor over the tensor-parallel ``group`` (returns the sum; may be a new tensor).

    Built by :func:`install_reducer`; ``kind`` says which path small messages take
    (``"nccl"`` or ``"symm_mem"``), ``norm_state`` is set when they go through Slipstream's
    one-kernel sum (``tensor_parallel.symm_mem_kernel = "slipstream"``).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.kind = "nccl"
        self.buffer: torch.Tensor | None = None  # the symmetric buffer (flat)
        self.group_name = ""
        self._fused: Any = None
        self._plain: Any = None
        self.gathered: torch.Tensor | None = None  # zeroed symmetric buffer for gather()
        self.norm_state: SymmNormState | None = None  # Slipstream's kernel (allreduce_norm)
        self.norm_why = ""  # why Slipstream's kernel is not used, when it was asked for
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        state = self.norm_state
        if state is not None and state.fits(x):
            return all_reduce_sum(state, x)
        buffer = self.buffer
        if (
            buffer is not None
            and x.dtype == buffer.dtype
            and x.is_cuda
            and x.numel() <= buffer.numel()
            and (x.numel() * x.element_size()) % 16 == 0
        ):
            x = x.contiguous()
            staged = buffer[: x.numel()].view(x.shape)
            out = torch.empty_like(x)
            if self._fused is not None and x.data_ptr() % 16 == 0:
                # (The fused copy needs the input as aligned as the buffer: 16 bytes.)
                self._fused(staged, x, "sum", self.group_name, out)
            else:
                staged.copy_(x)
                self._plain(staged, "sum", self.group_name, out)
            return out
        dist.all_reduce(x, group=self.group)
        return x

    def add_rms_norm(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total, rms_norm(total) * weight)`` with ``total = residual + partial`` summed over
        the group: one kernel with Slipstream's symmetric-memory sum, else the sum and then
        ``add_rms_norm`` (the same math; the fused kernel rounds the sum once less)."""
        state = self.norm_state
        if state is not None and state.fits(partial, residual):
            return reduce_add_rms_norm(state, partial, residual, weight, eps)
        return add_rms_norm(self(partial), residual, weight, eps)  # type: ignore[no-any-return]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` joined along the last dimension in rank order (the vocab-parallel
        head's logits).

        On the symmetric-memory path each rank writes its slice into its own part of a
        zeroed buffer of the joined shape, and the one-shot sum joins them exactly (every
        other element is a zero): two kernels instead of NCCL's all-gather and a concatenation.
        Each rank only ever writes its own slices (at the same places for every batch size),
        so the rest of its buffer stays zero.
        """
        gathered = self.gathered
        world = self.world
        joined = (*x.shape[:-1], x.shape[-1] * world)
        if (
            gathered is not None
            and x.dtype == gathered.dtype
            and x.is_cuda
            and x.numel() * world <= gathered.numel()
        ):
            staged = gathered[: x.numel() * world].view(joined)
            width = x.shape[-1]
            staged[..., self.rank * width : (self.rank + 1) * width].copy_(x)
            out = torch.empty(joined, dtype=x.dtype, device=x.device)
            self._plain(staged, "sum", self.group_name, out)
            return out
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def setup_symm_mem(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int,
        kernel: str = "slipstream",
    ) -> str:
        """Map a ``max_bytes`` symmetric buffer on every rank and check one sum with it; with
        ``kernel = "slipstream"`` also set up and check Slipstream's kernel (torch's is kept
        if that fails).

        Returns "" on success, else why not (the same answer on every rank: the check's
        outcome is agreed by an all-reduce).
        """
        why = ""
        ops = _symm_ops() if device.type == "cuda" else None
        if device.type != "cuda":
            why = f"the model is on {device.type}, not CUDA"
        elif "nccl" not in str(dist.get_backend(self.group)):
            why = f"the group's backend is {dist.get_backend(self.group)}, not nccl"
        elif dtype not in _SYMM_DTYPES:
            why = f"the one-shot kernel has no {dtype} (bf16 and fp32 only)"
        elif ops is None:
            why = "this torch has no torch.ops.symm_mem one-shot all-reduce"
        if why or ops is None:
            return why
        import torch.distributed._symmetric_memory as symm_mem

        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None
        self.group_name = group.group_name
        self._fused, self._plain = ops
        ok = torch.ones(1, device=device)
        try:
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(self.group_name)
            numel = max(max_bytes // dtype.itemsize, 1)
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group)
            gathered = symm_mem.empty(numel, dtype=dtype, device=device)
            gathered.zero_()
            symm_mem.rendezvous(gathered, group)
            self.buffer, self.gathered = buffer, gathered
            rank, world = self.rank, self.world
            probe = torch.full((2, 2048), float(rank + 1), dtype=dtype, device=device)
            got = self(probe)
            want = float(world * (world + 1) // 2)
            joined = self.gather(probe[:, :1000])
            expect = torch.arange(1, world + 1, device=device).repeat_interleave(1000)
            if not bool((got == want).all()):
                why = f"the test sum was wrong ({got[0, 0].item()} for {want})"
            elif not torch.equal(joined.float(), expect.float().expand(2, -1)):
                why = "the test gather was wrong"
            # The probe wrote slices of another width: zero again (the model's slices lie
            # elsewhere). The gather's closing barrier means no peer still reads this buffer.
            gathered.zero_()
        except Exception as error:  # any setup failure: NCCL instead (agreed below)
            why = f"setup failed: {error}"
        if why:
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not bool(ok.item()):
            self.buffer = self.gathered = None
            return why or "another rank's symmetric-memory setup failed"
        self.kind = "symm_mem"
        if kernel == "slipstream":
            why = self.norm_why = self._setup_norm_kernel(device, dtype, max_bytes)
            if why:
                logger.info(
                    "tensor_parallel.symm_mem_kernel slipstream unavailable (%s): torch's "
                    "one-shot kernel sums",
                    why,
                )
        return ""

    def _agree(self, ok: bool, device: torch.device) -> bool:
        """Whether ``ok`` holds on every rank of the group."""
        flag = torch.ones(1, device=device) if ok else torch.zeros(1, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _setup_norm_kernel(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> str:
        """Map Slipstream's kernel's receive buffer, and check it (see
        :mod:`slipstream.inference.allreduce_norm`); returns "" or why not, agreed."""
        import torch.distributed._symmetric_memory as symm_mem

        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None
        why, state = "", None
        try:
            slot_words = max(max_bytes // 4, 1)  # words of one call's rows
            recv = symm_mem.empty(2 * self.world * slot_words, dtype=torch.int64, device=device)
            handle = symm_mem.rendezvous(recv, group)
            recv_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
            state = SymmNormState(recv, recv_ptrs, self.rank, self.world, MAX_BLOCKS)
            state.reset()
            torch.cuda.synchronize(device)
        except Exception as error:  # torch's kernel instead (agreed below)
            why = f"setup failed: {error}"
        # Every rank's buffer is clear before any rank's first push.
        if not self._agree(not why, device):
            return why or "another rank's setup failed"
        assert state is not None
        try:
            state.spin = 1 << 24  # a rank that failed to launch costs seconds, not a minute
            why = _check_norm_kernel(state, device, dtype)
            state.spin = MAX_SPIN
        except Exception as error:
            why = f"the test failed: {error}"
        if not self._agree(not why, device):
            return why or "another rank's test failed"
        self.norm_state = state
        return ""


def _check_norm_kernel(state: SymmNormState, device: torch.device, dtype: torch.dtype) -> str:
    """Slipstream's kernel against its torch reference on every rank's known inputs: one row,
    a few, and more rows than programs, sums alone and with the add + RMSNorm; "" if right."""
    width = 1024
    for rows in (1, 3, 2 * state.blocks + 1):
        index = torch.arange(rows * width, device=device).view(rows, width)
        parts = [((index * (r + 3)) % 17 - 8).to(dtype) / 8 for r in range(state.world)]
        residual = ((index % 13) - 6).to(dtype) / 4
        weight = (1 + (torch.arange(width, device=device) % 5) / 8).to(dtype)
        got = all_reduce_sum(state, parts[state.rank])
        if not torch.equal(got, reference_sum(parts)):
            return f"the test sum of {rows} rows was wrong"
        total, normed = reduce_add_rms_norm(state, parts[state.rank], residual, weight, 1e-5)
        want_total, want_normed = reference(parts, residual, weight, 1e-5)
        if not torch.equal(total, want_total):
            return f"the test residual add of {rows} rows was wrong"
        if not torch.allclose(normed.float(), want_normed.float(), rtol=1e-2, atol=1e-2):
            return f"the test RMSNorm of {rows} rows was wrong"
    if int(state.error.item()):
        return "a wait for a peer's words gave up"
    return ""


def install_reducer(
    model: Any,
    group: dist.ProcessGroup | None,
    mode: str,
    max_bytes: int,
    device: torch.device,
    kernel: str = "slipstream",
) -> TPReducer:
    """Give every block of a sharded ``model`` (and its vocab-parallel embedding) one reducer.

    A collective: every rank of ``group`` calls it. ``mode`` is
    ``tensor_parallel.allreduce``; ``"symm_mem"`` that cannot run raises ValueError.
    ``kernel`` is ``tensor_parallel.symm_mem_kernel``.
    """
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"tensor_parallel.allreduce = {mode!r}: choose one of {ALLREDUCE_MODES}")
    if kernel not in SYMM_MEM_KERNELS:
        raise ValueError(
            f"tensor_parallel.symm_mem_kernel = {kernel!r}: choose one of {SYMM_MEM_KERNELS}"
        )
    reducer = TPReducer(group)
    if mode != "nccl":
        dtype = model.embed.weight.dtype
        why = reducer.setup_symm_mem(device, dtype, max_bytes, kernel)
        if why and mode == "symm_mem":
            raise ValueError(
                f'tensor_parallel.allreduce = "symm_mem" cannot run here: {why}. Use "symm_mem_or_nccl" '
                '(symm_mem where it can run, else NCCL/gloo) or "nccl"'
            )
        if why:
            logger.info("tensor_parallel.allreduce auto: NCCL/gloo sums (%s)", why)
    for block in model.blocks:
        block.reducer = reducer
    if hasattr(model.embed, "reducer"):
        model.embed.reducer = reducer
    model.head_reducer = reducer
    logger.info(
        "tensor-parallel sums: %s%s",
        reducer.kind,
        " (slipstream kernel, add + RMSNorm fused)" if reducer.norm_state is not None else "",
    )
    return reducer
