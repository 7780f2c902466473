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

Both are captured in the CUDA graph of the decode step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ALLREDUCE_MODES", "TPReducer", "install_reducer"]

logger = logging.getLogger(__name__)

ALLREDUCE_MODES = ("symm_mem_or_nccl", "nccl", "symm_mem")
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
    (``"nccl"`` or ``"symm_mem"``).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.kind = "nccl"
        self.buffer: torch.Tensor | None = None  # the symmetric buffer (flat)
        self.group_name = ""
        self._fused: Any = None
        self._plain: Any = None
        self.gathered: torch.Tensor | None = None  # zeroed symmetric buffer for gather()
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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

    def setup_symm_mem(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> str:
        """Map a ``max_bytes`` symmetric buffer on every rank and check one sum with it.

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
        return ""


def install_reducer(
    model: Any,
    group: dist.ProcessGroup | None,
    mode: str,
    max_bytes: int,
    device: torch.device,
) -> TPReducer:
    """Give every block of a sharded ``model`` (and its vocab-parallel embedding) one reducer.

    A collective: every rank of ``group`` calls it. ``mode`` is
    ``tensor_parallel.allreduce``; ``"symm_mem"`` that cannot run raises ValueError.
    """
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"tensor_parallel.allreduce = {mode!r}: choose one of {ALLREDUCE_MODES}")
    reducer = TPReducer(group)
    if mode != "nccl":
        dtype = model.embed.weight.dtype
        why = reducer.setup_symm_mem(device, dtype, max_bytes)
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
    logger.info("tensor-parallel sums: %s", reducer.kind)
    return reducer
