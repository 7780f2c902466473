"""HostOptimizer: a torch optimizer's update, run on the CPU by Slipstream's C++ kernels.

ZeRO-Offload keeps the fp32 master weights and the optimizer states in host memory and runs
the update there. The optimizer object stays the user's ``torch.optim.Optimizer`` (its
``param_groups`` hold the host masters; schedulers and checkpoints see what they always see),
but its ``step`` is replaced by :meth:`HostOptimizer.step`, which

- recognises Adam/AdamW, Adagrad and Slipstream's Lion and runs the matching SIMD/OpenMP C++
  step from ``slipstream.kernels`` on the optimizer's own state tensors (same keys, same
  layout as torch's, so a checkpoint moves freely between offloaded and device runs), with
  the low-precision copy of each updated weight written in the same pass;
- falls back to the optimizer's own ``step`` for anything else (logged once: correct, slower);
- walks the parameters in sub-groups of ``sub_group_numel`` elements, so that each finished
  sub-group can be uploaded (``on_sub_group``) while the next one steps, and so that NVMe
  offload needs only a sub-group's states in memory at a time (``swapper``);
- with the C++ Adam, can also take a *speculative* step (:meth:`speculate_params`): the
  update is written out of place into spare buffers, leaving the masters and states as they
  were, and is later either committed (the spare buffers and the live ones trade places, no
  copy) or thrown away. ZeRO-Offload uses it to step during backward while the gradient norm
  that decides the clipping is not known yet;
- can freeze the hyper-parameters it reads (:meth:`freeze_hyperparameters`): a step that goes
  on in the background after ``engine.step()`` returned keeps the learning rate it started
  with while the scheduler moves the groups' to the next step's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from slipstream.offload.gpu_stream import AdamHyper, StreamedAdam
from slipstream.offload.settings import OptimizerOffload
from slipstream.offload.threads import choose_threads

__all__ = ["HostOptimizer", "StateSwapper", "kernel_for", "step_subset"]

logger = logging.getLogger(__name__)


class StateSwapper(Protocol):
    """What HostOptimizer needs from an NVMe swapper (see slipstream.offload.nvme)."""

    def swap_in(self, params: Sequence[torch.Tensor]) -> None: ...

    def prefetch(self, params: Sequence[torch.Tensor]) -> None: ...

    def swap_out(self, params: Sequence[torch.Tensor]) -> None: ...

    def finish(self) -> None: ...


@dataclass(slots=True)
class _Speculation:
    """One parameter's speculative update: where it went and what it assumed."""

    param: torch.Tensor
    value: torch.Tensor  # the updated master (spare buffer)
    exp_avg: torch.Tensor  # the updated states (spare buffers)
    exp_avg_sq: torch.Tensor
    assumed: tuple[Any, ...]  # hyper-parameters, step number and grad scale it used


def kernel_for(optimizer: torch.optim.Optimizer) -> tuple[str | None, str]:
    """``(kernel, why)``: the C++ step that reproduces ``optimizer``'s update, or None and why not."""
    from slipstream.kernels.optim import Lion

    name = type(optimizer).__name__
    # Every group counts: a flag may be set for one parameter group only.
    settings = [optimizer.defaults, *optimizer.param_groups]
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if any(group.get(flag) for group in settings):
                return None, f"{name}({flag}=True) has no C++ step"
        return "adam", f"{name}: C++ Adam"
    if type(optimizer) is torch.optim.Adagrad:
        if any(g.get("lr_decay", 0) != 0 or g.get("maximize") for g in settings):
            return None, f"{name} with lr_decay or maximize has no C++ step"
        return "adagrad", f"{name}: C++ Adagrad"
    if type(optimizer) is Lion:
        return "lion", f"{name}: C++ Lion"
    return None, f"{name} has no C++ step (Adam, AdamW, Adagrad and Lion do)"


def step_subset(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Run ``optimizer``'s own ``step()`` over ``params`` alone (a subset of its parameters):
    each group is narrowed to its members among them for one call, then restored."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) in chosen]
    try:
        optimizer.step()
    finally:
        for group, members in zip(groups, saved):
            group["params"] = members


def _frozen_value(value: Any) -> Any:
    """A group setting as it is now: a one-element tensor (a tensor ``lr``, which schedulers
    update in place) read into a float, tuples (``betas``) element by element."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, tuple):
        return tuple(_frozen_value(v) for v in value)
    return value


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension. The masters and their spares are flat shards already, and
    skipping ``view`` there matters on the CPU step's worker thread: every torch op gives the
    GIL up and takes it back, and each take can wait for the thread running the forward."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def _chunks(params: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for param in params:
        if current and size + param.numel() > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        chunks.append(current)
    return chunks


class HostOptimizer:
    """Runs ``optimizer``'s update on the CPU over its (host, fp32) parameters.

    Args:
        optimizer: a torch optimizer whose parameters are contiguous fp32 CPU tensors whose
            ``.grad`` (fp32, CPU) is set before :meth:`step`.
        settings: the offload settings (sub-group size, threads).
        copies: ``id(param) -> tensor`` to refresh with each updated value (the model's
            low-precision weights or a pinned staging buffer for them), same numel.
        swapper: NVMe offload: brings each sub-group's masters and states in before its step
            and writes them back after.
        grad_of: where a parameter's gradient is (default: its ``.grad``); ZeRO-Offload keeps
            gradients that landed in bf16 beside the fp32 masters. Only the C++ steps read
            such gradients; the fallback needs them as ``.grad``.
        params: the optimizer's parameters this steps (default: all of them). Partial
            offload leaves the others on the GPU, where the optimizer's own step updates them.
        device: the accelerator that steps ``settings.gpu_share`` of each Adam/AdamW call's
            elements, streamed from and back to host memory (:class:`StreamedAdam`); None:
            the CPU steps them all. Used only with the C++ Adam, without copies or a swapper.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        settings: OptimizerOffload,
        *,
        copies: Mapping[int, torch.Tensor] | None = None,
        swapper: StateSwapper | None = None,
        announce: bool = True,
        allocate: Callable[[torch.Size], torch.Tensor] | None = None,
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        params: Sequence[torch.Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.optimizer = optimizer
        self._grad_of = grad_of or (lambda param: param.grad)
        self.settings = settings
        self.copies = dict(copies or {})
        self.swapper = swapper
        every = [p for group in optimizer.param_groups for p in group["params"]]
        if params is None:
            self.params = every
        else:
            chosen = {id(p) for p in params}
            self.params = [p for p in every if id(p) in chosen]  # in the optimizer's order
            if len(self.params) != len(chosen):
                raise ValueError("HostOptimizer params must be parameters of the optimizer")
        for param in self.params:
            if param.device.type != "cpu" or param.dtype != torch.float32:
                raise ValueError(
                    "HostOptimizer steps fp32 CPU tensors; got a parameter of dtype "
                    f"{param.dtype} on {param.device}"
                )
        self.kernel, why = kernel_for(optimizer)
        if self.kernel is not None:
            try:
                from slipstream.kernels.ops import cpu_optim

                self._ops: Any = cpu_optim
                cpu_optim.supported_isas()  # loads (or builds) the extension now, not mid-step
            except ImportError as exc:
                why = f"the C++ CPU optimizers are unavailable ({exc})"
                self.kernel = None
        self.threads = choose_threads(settings.cores_fraction, settings.threads)
        if self.kernel is not None:
            self._ops.set_num_threads(self.threads.threads)
        self.description = (
            f"{why}; {self.threads.threads} thread(s) ({self.threads.reason})"
            if self.kernel is not None
            else f"{why}: running {type(optimizer).__name__}.step() on the CPU instead (slower)"
        )
        if announce:
            (logger.info if self.kernel else logger.warning)(
                "CPU optimizer step: %s", self.description
            )
        self._group_of = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        self.sub_groups = _chunks(self.params, settings.sub_group_numel)
        # Speculative steps: the spare master (from ``allocate``, e.g. pinned like the masters)
        # and spare states of each parameter, allocated on its first speculative step and
        # alternating with the live ones; what the pending speculative updates assumed.
        self._allocate = allocate or (lambda shape: torch.empty(shape, dtype=torch.float32))
        self._spares: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._speculated: dict[int, _Speculation] = {}
        # Group settings as freeze_hyperparameters() saw them (None: read the live groups).
        self._frozen: list[dict[str, Any]] | None = None
        self._reading = threading.Lock()
        # The C++ Adam's own clock, summed over its calls (benchmarks; kernel_s).
        self._kernel = [0.0, 0.0, 0.0, 0.0]
        # gpu_share: that share of each Adam call's elements steps on ``device``, streamed.
        self.gpu_share = 0.0
        self._streamed: StreamedAdam | None = None
        self._streaming = threading.Lock()
        # Queues the streamed share (a few torch calls per chunk, each holding the GIL) while
        # the calling thread runs the C++ share, which releases the GIL: queued first on the
        # calling thread, the C++ share would start only once every chunk is queued.
        self._enqueuer: ThreadPoolExecutor | None = None
        # gpu_share in training (ZeRO-Offload, stages 1-2): gradients the caller lends on the
        # device (``id(param)`` -> the whole flat gradient there, equal to the host one), which
        # the streamed share reads instead of the host copy; and, with ``keep_dtype`` set, the
        # streamed share's new values cast to it, kept on the device for the publish
        # (``id(param)`` -> (first streamed element, values)): those elements then need neither
        # a gradient read from host memory nor an upload of the new master.
        self.device_grads: dict[int, torch.Tensor] = {}
        self.keep_dtype: torch.dtype | None = None
        self._kept: dict[int, tuple[int, torch.Tensor]] = {}
        self._keeping = threading.Lock()
        if settings.gpu_share > 0 and device is not None:
            why = ""
            if self.kernel != "adam":
                why = f"it streams Adam/AdamW only ({self.description})"
            elif swapper is not None:
                why = "NVMe offload swaps the states (device 'cpu' only)"
            if why:
                if announce:
                    logger.warning("offload_optimizer.gpu_share has no effect: %s", why)
            else:
                self.gpu_share = settings.gpu_share
                self._streamed = StreamedAdam(device)
                if announce:
                    logger.info(
                        "offload_optimizer.gpu_share %g: that share of each step's elements "
                        "is stepped on %s (states streamed from and back to host memory), the "
                        "rest by the CPU at the same time",
                        self.gpu_share,
                        device,
                    )

    # ------------------------------------------------------------------ hyper-parameters
    def freeze_hyperparameters(self) -> None:
        """Read every group's settings (lr, betas, eps, weight decay, ...) as they are now until
        :meth:`thaw_hyperparameters`: steps and speculations taken meanwhile, and the check of
        :meth:`commit_speculation`, use these, whatever a scheduler writes into the groups.
        Only the C++ steps can: the fallback runs the optimizer's own step, on its live groups."""
        if self.kernel is None:
            raise RuntimeError(
                f"hyper-parameters can be frozen for the C++ steps only ({self.description})"
            )
        with self._reading:
            self._frozen = [self._settings(group) for group in self.optimizer.param_groups]

    def thaw_hyperparameters(self) -> None:
        """Read the live groups again (see :meth:`freeze_hyperparameters`)."""
        with self._reading:
            self._frozen = None

    @staticmethod
    def _settings(group: dict[str, Any]) -> dict[str, Any]:
        return {k: _frozen_value(v) for k, v in group.items() if k != "params"}

    def _group(self, index: int) -> dict[str, Any]:
        """Group ``index``'s settings as values: the frozen ones while frozen, else the live
        group's now. Read under a lock that freezing takes too, so a step on the worker reads
        either all of them before a freeze (and so before the scheduler that follows it
        changes them) or the frozen ones."""
        with self._reading:
            frozen = self._frozen
            if frozen is not None:
                return frozen[index]
            return self._settings(self.optimizer.param_groups[index])

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(
        self,
        grad_scale: float = 1.0,
        on_sub_group: Callable[[list[torch.Tensor]], None] | None = None,
        before_sub_group: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        """Update every parameter that has a gradient, one sub-group at a time.

        ``grad_scale`` multiplies each gradient as the step reads it (loss unscaling and the
        clip coefficient, without a separate pass over the gradients). ``on_sub_group(params)``
        runs after each sub-group's update (its copies refreshed); ``before_sub_group(params)``
        before it (e.g. to make the sub-group's copy targets resident).
        """
        swapper = self.swapper
        for index, chunk in enumerate(self.sub_groups):
            if before_sub_group is not None:
                before_sub_group(chunk)
            if swapper is not None:
                swapper.swap_in(chunk)
                if index + 1 < len(self.sub_groups):
                    swapper.prefetch(self.sub_groups[index + 1])
            self.step_params(chunk, grad_scale)
            if on_sub_group is not None:
                on_sub_group(chunk)
            if swapper is not None:
                swapper.swap_out(chunk)
        if swapper is not None:
            swapper.finish()

    def step_params(
        self, params: Sequence[torch.Tensor], grad_scale: float = 1.0, keep: bool = False
    ) -> None:
        """Update ``params`` (a subset of the optimizer's) that have a gradient; ``keep``:
        keep the streamed share's new values on the device (:meth:`take_kept`)."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for param in params:
            if self._grad_of(param) is not None:
                by_group.setdefault(self._group_of[id(param)], []).append(param)
        if self.kernel is None:
            self._fallback(by_group, grad_scale)
            return
        for group_index, members in by_group.items():
            group = self._group(group_index)
            if self.kernel == "adam":
                self._adam(group, members, grad_scale, keep)
            elif self.kernel == "adagrad":
                self._adagrad(group, members, grad_scale)
            else:
                self._lion(group, members, grad_scale)

    # ------------------------------------------------------------------ speculative steps
    @property
    def can_speculate(self) -> bool:
        """Whether :meth:`speculate_params` is available (the C++ Adam/AdamW, no swapper)."""
        return self.kernel == "adam" and self.swapper is None

    def spare_bytes(self) -> int:
        """Host memory the spare buffers of speculative steps take (12 bytes per element)."""
        return 12 * sum(p.numel() for p in self.params)

    def reserve_spares(self) -> None:
        """Allocate every parameter's spare buffers now (else on its first speculative step,
        on whichever thread takes it)."""
        for param in self.params:
            self._spare_of(param)

    def _spare_of(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spare = self._spares.get(id(param))
        if spare is None:
            # Streamed (gpu_share): the states come from the allocator too (pinned: the copies
            # to and from the device are asynchronous); else plain host memory.
            state = self._allocate if self._streamed is not None else self._plain
            spare = (self._allocate(param.shape), state(param.shape), state(param.shape))
            self._spares[id(param)] = spare
        return spare

    @staticmethod
    def _plain(shape: torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32)

    def _new_adam_state(self, param: torch.Tensor, entry: dict[str, Any]) -> None:
        """Adam's state as torch creates it (pinned, from the allocator, when streamed)."""
        entry["step"] = torch.tensor(0.0, dtype=torch.float32)
        if self._streamed is None:
            entry["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            entry["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            entry["exp_avg"] = self._allocate(param.shape).zero_()
            entry["exp_avg_sq"] = self._allocate(param.shape).zero_()

    def _run_adam(
        self,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        hyper: AdamHyper,
        copies: list[torch.Tensor] | None,
        out: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None,
        keep: bool = False,
    ) -> None:
        """One Adam/AdamW call: the C++ step over everything, or (``gpu_share``) the last
        ``gpu_share`` of each tensor's elements streamed through the device while the C++
        step takes the rest at the same time (reading a lent device gradient where there is
        one; with ``keep`` and ``keep_dtype``, keeping the streamed new values on the device:
        :meth:`take_kept`)."""
        grads = self._grads(params)
        streamed = self._streamed
        if streamed is None or copies is not None:
            self._cpp_adam(params, grads, exp_avgs, exp_avg_sqs, hyper, copies, out)
            return
        lists: list[list[torch.Tensor]] = [params, grads, exp_avgs, exp_avg_sqs]
        if out is not None:
            lists += list(out)
        cpu: list[list[torch.Tensor]] = [[] for _ in lists]
        gpu: list[list[torch.Tensor]] = [[] for _ in lists]
        streamed_ids: list[tuple[int, int]] = []  # (id(param), first streamed element)
        keep_dtype = self.keep_dtype if keep else None
        for index, param in enumerate(params):
            numel = param.numel()
            split = numel - round(numel * self.gpu_share)
            for column, tensors in enumerate(lists):
                flat = tensors[index].view(-1)
                if split > 0:
                    cpu[column].append(flat[:split])
                if split < numel:
                    gpu[column].append(flat[split:])
            if split < numel:
                lent = self.device_grads.get(id(param))
                if lent is not None:
                    gpu[1][-1] = lent.view(-1)[split:]
                streamed_ids.append((id(param), split))
        gpu_out = (gpu[4], gpu[5], gpu[6]) if out is not None else None
        cpu_out = (cpu[4], cpu[5], cpu[6]) if out is not None else None
        with self._streaming:  # one call at a time uses the streamer's buffers and streams
            queued: Future[list[torch.Tensor]] | None = None
            kept: list[torch.Tensor] = []
            if gpu[0]:
                args = (gpu[0], gpu[1], gpu[2], gpu[3], hyper, gpu_out, keep_dtype)
                if cpu[0]:
                    # Queued beside the C++ share (the slices are disjoint); see _enqueuer.
                    if self._enqueuer is None:
                        self._enqueuer = ThreadPoolExecutor(1, "slipstream-gpu-share")
                    queued = self._enqueuer.submit(streamed.enqueue, *args)
                else:
                    kept = streamed.enqueue(*args)
            try:
                if cpu[0]:
                    self._cpp_adam(cpu[0], cpu[1], cpu[2], cpu[3], hyper, None, cpu_out)
            finally:
                try:
                    if queued is not None:
                        kept = queued.result()  # raises what the queueing raised
                finally:
                    streamed.wait()
            with self._keeping:
                for (key, split), values in zip(streamed_ids, kept):
                    self._kept[key] = (split, values)

    def _cpp_adam(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        hyper: AdamHyper,
        copies: list[torch.Tensor] | None,
        out: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None,
    ) -> None:
        self._ops.adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            adam_w_mode=hyper.adam_w_mode,
            bias_correction=True,
            step=hyper.step,
            param_copies=copies,
            grad_scale=hyper.grad_scale,
            out=out,
            schedule=self.settings.cpu_schedule,
            stores=self.settings.cpu_stores,
            prefetch=self.settings.cpu_prefetch,
        )
        stats = self._ops.last_step_stats()
        if stats is not None:
            self._kernel[0] += stats["wall_s"]
            self._kernel[1] += stats["end_max_s"]
            self._kernel[2] += stats["end_mean_s"]
            self._kernel[3] += stats["start_max_s"]

    @property
    def kernel_s(self) -> tuple[float, float, float, float]:
        """The C++ Adam's own clock, summed over its calls so far (benchmarks): seconds inside
        its OpenMP regions; the sums of the latest and of the mean thread's end in each (their
        ratio is 1 when the threads finish together); and the sum of the latest thread's start
        (how long the region waited for its last thread to begin; see
        :func:`slipstream.kernels.ops.cpu_optim.last_step_stats`)."""
        return (self._kernel[0], self._kernel[1], self._kernel[2], self._kernel[3])

    def _decoupled(self, group: dict[str, Any]) -> bool:
        """AdamW's decoupled weight decay (AdamW, or Adam with ``decoupled_weight_decay``)."""
        return type(self.optimizer) is torch.optim.AdamW or bool(
            group.get("decoupled_weight_decay", False)
        )

    def _assumed(self, param: torch.Tensor, grad_scale: float) -> tuple[Any, ...]:
        group = self._group(self._group_of[id(param)])
        entry = self.optimizer.state[param]
        beta1, beta2 = group["betas"]
        return (
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            self._decoupled(group),
            int(entry["step"]) + 1,
            float(grad_scale),
        )

    @torch.no_grad()
    def speculate_params(
        self, params: Sequence[torch.Tensor], grad_scale: float = 1.0, keep: bool = False
    ) -> None:
        """Take ``params``' Adam update out of place: masters, states and step counts stay as
        they are; the new values wait in spare buffers for :meth:`commit_speculation` (the
        model-dtype ``copies`` are written with them, as in :meth:`step_params`, so after a
        discard they hold the speculative values until stepped again or refreshed). ``keep``:
        as in :meth:`step_params`."""
        if not self.can_speculate:
            raise RuntimeError(
                f"speculative steps need the C++ Adam/AdamW and no NVMe swapper ({self.description})"
            )
        state = self.optimizer.state
        by_key: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for param in params:
            if self._grad_of(param) is None:
                continue
            entry = state[param]
            if not entry:  # what the in-place step would create
                self._new_adam_state(param, entry)
            spare = self._spare_of(param)
            assumed = self._assumed(param, grad_scale)
            self._speculated[id(param)] = _Speculation(param, *spare, assumed)
            by_key.setdefault(assumed, []).append(param)
        for assumed, members in by_key.items():
            lr, beta1, beta2, eps, weight_decay, decoupled, step, scale = assumed
            for chunk, copies in self._split_by_copy(members):
                taken = [self._speculated[id(p)] for p in chunk]
                self._run_adam(
                    chunk,
                    [state[p]["exp_avg"] for p in chunk],
                    [state[p]["exp_avg_sq"] for p in chunk],
                    AdamHyper(lr, beta1, beta2, eps, weight_decay, decoupled, step, scale),
                    copies,
                    out=(
                        [_flat(t.value) for t in taken],
                        [_flat(t.exp_avg) for t in taken],
                        [_flat(t.exp_avg_sq) for t in taken],
                    ),
                    keep=keep,
                )

    def speculative_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """The pending speculative update of ``param`` (its new master), if any."""
        taken = self._speculated.get(id(param))
        return taken.value if taken is not None else None

    @property
    def speculation_pending(self) -> bool:
        """Whether speculative updates wait for :meth:`commit_speculation` or a discard."""
        return bool(self._speculated)

    def commit_speculation(self, grad_scale: float = 1.0) -> bool:
        """Make the pending speculative updates the step, if they are exactly the step that
        :meth:`step` would take now with ``grad_scale``; else change nothing.

        They are when every parameter that has a gradient was speculated, and each with the
        hyper-parameters its group has now (lr, betas, eps, weight decay), its current step
        number and this ``grad_scale``. Committing swaps the spare buffers in (the masters keep
        their identity: their ``.data`` is replaced) and advances the step counts. Returns
        whether it committed; either way nothing is pending afterwards.
        """
        pending, self._speculated = self._speculated, {}
        state = self.optimizer.state
        with_grad = 0
        for param in self.params:
            if self._grad_of(param) is None:
                continue
            with_grad += 1
            taken = pending.get(id(param))
            if taken is None or taken.assumed != self._assumed(param, grad_scale):
                return False
        if not pending or with_grad != len(pending):
            return False
        for taken in pending.values():
            param, entry = taken.param, state[taken.param]
            old = (param.data, entry["exp_avg"], entry["exp_avg_sq"])
            param.data = taken.value
            entry["exp_avg"], entry["exp_avg_sq"] = taken.exp_avg, taken.exp_avg_sq
            entry["step"] += 1
            self._spares[id(param)] = old
        self.drop_kept()  # everything kept was published before the step was settled
        return True

    def discard_speculation(self) -> bool:
        """Forget the pending speculative updates (masters and states never saw them; the
        model-dtype copies did: :meth:`refresh_copies`). Returns whether any were pending."""
        pending = bool(self._speculated)
        self._speculated = {}
        self.drop_kept()
        return pending

    def take_kept(self, param: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """The streamed share's new values of ``param`` kept on the device by its last step
        with ``keep`` (first streamed element, values in ``keep_dtype``), handed over once;
        None if there are none."""
        with self._keeping:
            return self._kept.pop(id(param), None)

    def drop_kept(self) -> None:
        """Forget every kept value nobody took (a step discarded or called off)."""
        with self._keeping:
            self._kept.clear()

    def refresh_copies(self) -> None:
        """Rewrite every model-dtype copy from its master (after a discarded speculation)."""
        self._refresh(self.params)

    def _refresh(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            copy = self.copies.get(id(param))
            if copy is not None:
                copy.copy_(param.view(copy.shape))

    def _fallback(self, by_group: dict[int, list[torch.Tensor]], scale: float) -> None:
        # The optimizer's own step over just these parameters: every group is narrowed to
        # its members in the sub-group (the others to none) for one call, then restored.
        members = [p for group in by_group.values() for p in group]
        if any(p.grad is None for p in members):
            raise RuntimeError(
                f"{type(self.optimizer).__name__}.step() on the CPU needs fp32 .grad tensors, "
                "but gradients were handed over elsewhere (grad_of); only the C++ steps read them"
            )
        if scale != 1.0 and members:
            torch._foreach_mul_(self._grads(members), scale)
        step_subset(self.optimizer, members)
        self._refresh(members)

    def _split_by_copy(
        self, members: list[torch.Tensor]
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        with_copy = [p for p in members if id(p) in self.copies]
        without = [p for p in members if id(p) not in self.copies]
        parts: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = []
        if with_copy:
            parts.append((with_copy, [self.copies[id(p)].view(-1) for p in with_copy]))
        if without:
            parts.append((without, None))
        return parts

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = []
        for param in params:
            grad = self._grad_of(param)
            assert grad is not None
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
        return grads

    def _adam(
        self, group: dict[str, Any], members: list[torch.Tensor], scale: float, keep: bool = False
    ) -> None:
        state = self.optimizer.state
        by_step: dict[float, list[torch.Tensor]] = {}
        for param in members:
            entry = state[param]
            if not entry:
                self._new_adam_state(param, entry)
            entry["step"] += 1
            by_step.setdefault(float(entry["step"]), []).append(param)
        beta1, beta2 = group["betas"]
        decoupled = self._decoupled(group)
        for step, same_step in by_step.items():
            for params, copies in self._split_by_copy(same_step):
                hyper = AdamHyper(
                    float(group["lr"]),
                    float(beta1),
                    float(beta2),
                    float(group["eps"]),
                    float(group["weight_decay"]),
                    decoupled,
                    int(step),
                    scale,
                )
                self._run_adam(
                    params,
                    [state[p]["exp_avg"] for p in params],
                    [state[p]["exp_avg_sq"] for p in params],
                    hyper,
                    copies,
                    keep=keep,
                )

    def _adagrad(self, group: dict[str, Any], members: list[torch.Tensor], scale: float) -> None:
        state = self.optimizer.state
        for param in members:
            entry = state[param]
            if not entry:
                entry["step"] = torch.tensor(0.0, dtype=torch.float32)
                entry["sum"] = torch.full_like(
                    param,
                    float(group["initial_accumulator_value"]),
                    memory_format=torch.preserve_format,
                )
            entry["step"] += 1
        for params, copies in self._split_by_copy(members):
            self._ops.adagrad(
                params,
                self._grads(params),
                [state[p]["sum"] for p in params],
                lr=float(group["lr"]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                param_copies=copies,
                grad_scale=scale,
                schedule=self.settings.cpu_schedule,
            )

    def _lion(self, group: dict[str, Any], members: list[torch.Tensor], scale: float) -> None:
        state = self.optimizer.state
        for param in members:
            entry = state[param]
            if not entry:
                entry["step"] = 0
                entry["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            entry["step"] += 1
        beta1, beta2 = group["betas"]
        for params, copies in self._split_by_copy(members):
            self._ops.lion(
                params,
                self._grads(params),
                [state[p]["exp_avg"] for p in params],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                param_copies=copies,
                grad_scale=scale,
                schedule=self.settings.cpu_schedule,
            )
