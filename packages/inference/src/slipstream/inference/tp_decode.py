"""Fused batch-1 decode under tensor parallelism: the row-parallel GEMVs push their partial sums.

With ``decode_fusion`` on, a tensor-parallel decode step runs per block the decode GEMVs of
:mod:`slipstream.inference.fused_decode` on this rank's shards; between a row-parallel
projection (output, down) and the next norm's GEMV, the partial outputs must be summed over the
group. Without this module (:func:`~slipstream.inference.fused_decode.decode_block`) each sum
is a kernel of its own (the symmetric-memory sum of ``tensor_parallel.symm_mem_kernel``: 64
launches a step for a 32-layer model). With ``tensor_parallel.gemv_push`` the sums have no
kernel: the row-parallel GEMV stores each word of its output straight into every peer's
receive buffer as it computes it, and the next norm GEMV adds the peers' words to its own
partial and the residual in its prologue (:func:`push_gemv`, :func:`pull_norm_gemv`).

Experimental and off by default: correct (CPU and 2-GPU tests) but measured slower than one
sum kernel per sum (2x H200, 8B Llama shapes, TP=2, batch 1: 238.8 against 333.8 tokens/s; the
pushing/pulling GEMVs averaged 28.7 us a call against 18.2 us for the plain decode GEMVs).

[Note: the push protocol of the fused TP decode step]
Every rank holds a receive buffer in symmetric memory (every rank has mapped every other
rank's) of 8-byte slots, one region per ``(site, sender)``; the sites are the step's pushed
sums, in order (block ``i``'s output projection is site ``2i``, its down projection ``2i + 1``;
the last block's down sum goes through the group's reducer, before the wide LM head). Each
fused decode step first adds one to a step counter on the device (the same number on every
rank: every rank runs the same steps). A pushing GEMV stores each 32-bit word of its output
(two bf16 or one fp32) beside the step's number, in one 8-byte store (seen whole or not at
all), into its region of the site in every peer's buffer; the pulling GEMV's programs poll
their own buffer until every word of the row carries this step's number (a poll gives up after
``SPIN`` tries and raises an error flag), then sum the ranks' partials in fp32 in rank order
(the same bits on every rank) and add the residual, exactly as
:func:`slipstream.inference.allreduce_norm.reference` does. One region per site suffices, with
no parity and no barrier: a peer pushes into site ``s`` again only in a later step, after the
step's last sum (through the reducer), which needs this rank's part, which this rank gives
after its stream has finished every pull of the step. Old words never pass for new ones (their
number is older).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "GATED",
    "PLAIN",
    "PushState",
    "pull_norm_gemv",
    "push_gemv",
    "reference_pull_norm_gemv",
    "setup_gemv_push",
    "symmetric_push_state",
    "tp_decode_forward",
]

logger = logging.getLogger(__name__)

PLAIN, NORM, GATED = 0, 1, 2  # the GEMV's prologue (as slipstream.kernels' decode_gemv)
MAX_SPIN = 1 << 26  # polls before a wait gives up (about a minute: far beyond any real wait)
_DTYPES = (torch.bfloat16, torch.float32)  # words of two bf16 or one fp32


class PushState:
    """What the pushing GEMVs need of one group's symmetric memory (built by
    :func:`setup_gemv_push`, or by a test that lays the buffers out itself).

    Attributes:
        recv: this rank's receive buffer, int64 slots: ``sites * world`` regions of
            ``region_words``.
        recv_ptrs: int64 device tensor, every rank's receive buffer address.
        step: int32 ``(1,)``, the fused decode steps begun (:meth:`begin_step`).
        error: int32 ``(1,)``, set by a kernel when a wait gave up.
    """

    def __init__(
        self,
        recv: torch.Tensor,
        recv_ptrs: torch.Tensor,
        rank: int,
        world: int,
        sites: int,
        region_words: int,
    ) -> None:
        if recv.dtype != torch.int64 or recv.numel() < sites * world * region_words:
            raise ValueError("the receive buffer must hold sites x world regions of int64 slots")
        self.recv, self.recv_ptrs = recv, recv_ptrs
        self.rank, self.world = rank, world
        self.sites, self.region_words = sites, region_words
        self.step = torch.zeros(1, dtype=torch.int32, device=recv.device)
        self.error = torch.zeros(1, dtype=torch.int32, device=recv.device)
        self.spin = MAX_SPIN
        # Launches (slipstream.kernels' DecodeGemvConfig): per (out_features, in_features,
        # pulls), else `config` for every GEMV, else the kernels' default_config.
        self.configs: dict[tuple[int, int, bool], Any] = {}
        self.config: Any = None
        # Pulling GEMVs keep the normalised row in registers (tp_gemv_kernel's ROW) where the
        # row is a power-of-two number of K steps (else they read it again per step).
        self.row_in_registers = False

    def reset(self) -> None:
        """The start state: no step made, no word received. Every rank must do it, and
        synchronize with the others, before the first step."""
        self.recv.zero_()
        self.step.zero_()
        self.error.zero_()

    def begin_step(self) -> None:
        """Number a new fused decode step (one small kernel; captured in the CUDA graph)."""
        self.step.add_(1)

    def fits(self, x: torch.Tensor, width: int) -> bool:
        """Whether a pushed/pulled row of ``width`` columns of ``x``'s dtype fits a region."""
        rows = x.numel() // max(x.shape[-1], 1)
        words = width // 2 if x.dtype == torch.bfloat16 else width
        return (
            x.dtype in _DTYPES
            and x.device == self.recv.device
            and width % 2 == 0
            and rows * words <= self.region_words
        )


def _kernel() -> Any:
    from slipstream.inference.tp_decode_triton import tp_gemv_kernel

    return tp_gemv_kernel


def _config(state: PushState, weight: torch.Tensor, pulls: bool) -> Any:
    from slipstream.kernels.ops.decode_gemv.triton import default_config

    out_features, in_features = weight.shape
    found = state.configs.get((out_features, in_features, pulls))
    if found is not None:
        return found
    if state.config is not None:
        return state.config
    return default_config(out_features, in_features, weight.device)


def _launch(
    state: PushState,
    prologue: int,
    x: torch.Tensor,
    partial: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    pull_site: int | None,
    push_site: int | None,
) -> torch.Tensor:
    import triton

    out_features, in_features = weight.shape
    rows = x.shape[0]
    config = _config(state, weight, pull_site is not None)
    block_n = max(config.block_n, 4)  # pushed bf16 words hold two columns (a 2 x 2 tile, at least)
    out = torch.empty(rows, out_features, device=weight.device, dtype=x.dtype)
    region = state.region_words
    programs = triton.cdiv(out_features, block_n)
    prefetch = bool(config.prefetch) and not config.programs_per_sm  # one block per program
    steps = in_features // config.block_k
    row_in_registers = (
        state.row_in_registers
        and prologue == NORM
        and in_features % config.block_k == 0
        and steps & (steps - 1) == 0
        and in_features <= 16384
    )
    if config.programs_per_sm and weight.is_cuda:
        # A persistent grid: each program's prologue (the pulled row's sum and norm) serves
        # several output blocks.
        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        programs = min(programs, config.programs_per_sm * sms)
    _kernel()[(programs, rows)](
        x,
        partial if partial is not None else x,
        norm_weight if norm_weight is not None else x,
        total if total is not None else out,
        weight,
        bias if bias is not None else weight,
        out,
        state.recv_ptrs,
        state.step,
        state.error,
        out_features,
        in_features,
        x.stride(0),
        out.stride(0),
        eps,
        (pull_site or 0) * state.world * region,
        (push_site or 0) * state.world * region,
        region,
        PROLOGUE=prologue,
        HAS_NORM_WEIGHT=norm_weight is not None,
        HAS_BIAS=bias is not None,
        EVEN_N=out_features % block_n == 0,
        EVEN_K=in_features % config.block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        PULL=pull_site is not None,
        PUSH=push_site is not None,
        PACKED=x.dtype == torch.bfloat16,
        RANK=state.rank,
        WORLD=state.world,
        SPIN=state.spin,
        PREFETCH=prefetch,
        ROW=in_features if row_in_registers else 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def push_gemv(
    state: PushState,
    site: int,
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's partial ``F.linear(h, weight, bias)`` (``h = x`` for :data:`PLAIN`,
    ``silu(gate) * up`` of ``x = [gate, up]`` for :data:`GATED`), also pushed into every
    peer's receive buffer as sum ``site`` of the step. Every rank must make the same calls."""
    flat = _rows(x)
    out = _launch(state, prologue, flat, None, None, None, weight, bias, 0.0, None, site)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def pull_norm_gemv(
    state: PushState,
    site: int,
    x: torch.Tensor,
    partial: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, F.linear(rms_norm(total, norm_weight, eps), weight, bias))`` where ``total``
    is ``x`` plus every rank's partial of sum ``site`` (this rank's ``partial``, the peers'
    pushed by their :func:`push_gemv`), as :func:`reference_pull_norm_gemv` computes it."""
    flat = _rows(x)
    part = _rows(partial)
    total = torch.empty_like(flat)
    out = _launch(state, NORM, flat, part, norm_weight, total, weight, bias, eps, site, None)
    return total.view(x.shape), out.reshape(*x.shape[:-1], weight.shape[0])


def reference_pull_norm_gemv(
    partials: list[torch.Tensor],
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pull_norm_gemv`'s math in torch, given every rank's partial: the fp32 sum in
    rank order plus ``x``, rounded once; its RMSNorm rounded where ``add_rms_norm`` rounds it;
    the projection in fp32."""
    from slipstream.inference.allreduce_norm import reference

    total, normed = reference(partials, x, norm_weight, eps)
    y = torch.nn.functional.linear(
        normed.float(), weight.float(), None if bias is None else bias.float()
    )
    return total, y.to(x.dtype)


def tp_decode_forward(
    model: Any,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: Any,
    slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """:func:`slipstream.inference.fused_decode.decode_forward` of a tensor-parallel ``model``
    whose sums ride on the GEMVs (``model.tp_push``, every part fused): per block the QKV
    norm GEMV (pulling the previous block's down sum), the split-K attention, the output GEMV
    (pushing), the gate/up norm GEMV (pulling it), the gated down GEMV (pushing; the last
    block's sums through the group's reducer); then the final norm and the vocab-parallel head,
    and the logits' gather."""
    from slipstream.kernels.ops import gated_gemv, norm_gemv

    state: PushState = model.tp_push
    state.begin_step()
    partial: torch.Tensor | None = None
    site, last = -1, len(model.blocks) - 1
    for index, block in enumerate(model.blocks):
        norm, post = block.input_norm, block.post_norm
        if partial is None:
            x, qkv = norm_gemv(x, None, norm.weight, norm.eps, block.qkv.weight, block.qkv.bias)
        else:
            x, qkv = pull_norm_gemv(
                state, site, x, partial, norm.weight, norm.eps, block.qkv.weight, block.qkv.bias
            )
        layer_cache = None if cache is None else (cache.keys[index], cache.values[index])
        attn = block._attend(qkv, rotary, layer_cache, slots, mask, True)
        site += 1
        partial = push_gemv(state, site, PLAIN, attn, block.out.weight, block.out.bias)
        x, up = pull_norm_gemv(
            state, site, x, partial, post.weight, post.eps, block.up.weight, block.up.bias
        )
        site += 1
        if index < last:
            partial = push_gemv(state, site, GATED, up, block.down.weight, block.down.bias)
        else:
            # The head's GEMV is wide (vocab / tp_size rows): a pull in each of its thousands
            # of programs would cost more than the one sum kernel before it.
            partial = block._reduce(gated_gemv(up, block.down.weight, block.down.bias))
    norm, head = model.final_norm, model.head
    assert partial is not None
    logits = norm_gemv(x, partial, norm.weight, norm.eps, head.weight, head.bias)[1]
    return model.gather_vocab(logits)  # type: ignore[no-any-return]


def push_blockers(model: Any) -> list[str]:
    """Why ``model``'s fused decode step cannot push its sums (empty: it can)."""
    from slipstream.inference.fused_decode import PARTS

    reasons = []
    if model.decode_fusion != PARTS:
        reasons.append("decode_fusion does not run every part")
    if getattr(model.blocks[0], "tp_group", None) is None:
        reasons.append("the model is not tensor-parallel")
    if model.embed.weight.dtype not in _DTYPES:
        reasons.append(f"the model is in {model.embed.weight.dtype} (bf16 or fp32 words)")
    if model.spec.hidden_size % 2:
        reasons.append("the hidden size is odd")
    linears = [getattr(b, n, None) for b in model.blocks for n in ("qkv", "out", "up", "down")]
    if not all(isinstance(x, nn.Linear) and x.weight.dtype in _DTYPES for x in linears):
        reasons.append("some block linears are not dense bf16/fp32 (quantized weights)")
    return reasons


def _check(state: PushState, device: torch.device, dtype: torch.dtype) -> str:
    """A push and a pull on every rank's known inputs against the torch reference; "" if
    right. Two steps, so that the counter and the regions are used twice."""
    width, out = 256, 96
    index = torch.arange(width, device=device)
    outs = torch.arange(out, device=device)
    down = ((((index[:, None] * 7 + outs[None, :]) % 11) - 5) / 8).to(dtype)  # (width, out)
    head = ((((outs[:, None] * 3 + index[None, :]) % 7) - 3) / 4).to(dtype)  # (out, width)
    norm_weight = (1 + (index % 5) / 8).to(dtype)
    x = (((index % 13) - 6) / 4).to(dtype)[None]
    for step in range(2):
        state.begin_step()
        inputs = [
            (((outs * (r + 3 + step)) % 17 - 8) / 8).to(dtype)[None] for r in range(state.world)
        ]
        partials = [torch.nn.functional.linear(h.float(), down.float()).to(dtype) for h in inputs]
        mine = push_gemv(state, step % state.sites, PLAIN, inputs[state.rank], down)
        if not torch.allclose(mine.float(), partials[state.rank].float(), rtol=1e-2, atol=1e-2):
            return "the test GEMV was wrong"
        partials[state.rank] = mine
        total, y = pull_norm_gemv(state, step % state.sites, x, mine, norm_weight, 1e-5, head)
        want_total, want_y = reference_pull_norm_gemv(partials, x, norm_weight, 1e-5, head)
        del want_total
        # The peers' partials were computed here by torch, theirs by the kernel: compare
        # within rounding (the sums and norms themselves are checked bit for bit in the tests).
        if int(state.error.item()):
            return "a wait for a peer's words gave up"
        if not torch.allclose(y.float(), want_y.float(), rtol=3e-2, atol=3e-2):
            return "the test pull GEMV was wrong"
        if not torch.isfinite(total.float()).all():
            return "the test residual sum was not finite"
    return ""


def setup_gemv_push(model: Any, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """Map the receive buffer of the pushed sums on every rank of ``group`` and check a push
    and a pull; on success set ``model.tp_push``. A collective. Returns "" or why not (the
    same answer on every rank)."""
    why = ""
    blockers = push_blockers(model)
    if blockers:
        return "; ".join(blockers)
    if device.type != "cuda":
        why = f"the model is on {device.type}, not CUDA"
    elif "nccl" not in str(dist.get_backend(group)):
        why = f"the group's backend is {dist.get_backend(group)}, not nccl"
    if why:
        return why
    # One row (batch-1 decode) per site: of fp32 words, or of bf16 pairs.
    state, why = symmetric_push_state(group, device, 2 * len(model.blocks), model.spec.hidden_size)
    if state is None:
        return why
    try:
        state.spin = 1 << 24  # a rank that failed to launch costs seconds, not a minute
        why = _check(state, device, model.embed.weight.dtype)
        state.spin = MAX_SPIN
        torch.cuda.synchronize(device)
    except Exception as error:
        why = f"the test failed: {error}"
    if not _agree(not why, group, device):
        return why or "another rank's test failed"
    # Every rank has read every word of the test (its pulls finished): clear, then agree again
    # so that no rank's first real push lands before a peer has cleared its buffer.
    state.reset()
    torch.cuda.synchronize(device)
    _agree(True, group, device)
    model.tp_push = state
    return ""


def symmetric_push_state(
    group: dist.ProcessGroup | None, device: torch.device, sites: int, region_words: int
) -> tuple[PushState | None, str]:
    """A :class:`PushState` over a receive buffer in symmetric memory mapped by every rank of
    ``group`` (a collective), reset on every rank; or None and why not (agreed)."""
    why, state = "", None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        whole = group if group is not None else dist.group.WORLD
        assert whole is not None
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(whole.group_name)
        recv = symm_mem.empty(sites * world * region_words, dtype=torch.int64, device=device)
        handle = symm_mem.rendezvous(recv, whole)
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        state = PushState(recv, ptrs, rank, world, sites, region_words)
        state.reset()
        torch.cuda.synchronize(device)
    except Exception as error:  # the per-sum kernels instead (agreed below)
        why = f"setup failed: {error}"
    if not _agree(not why, group, device):
        return None, why or "another rank's setup failed"
    return state, ""


def _agree(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    flag = torch.ones(1, device=device) if ok else torch.zeros(1, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
