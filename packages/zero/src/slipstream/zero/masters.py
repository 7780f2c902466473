"""ShardedMasterWeights: the fp32 shards of trainable parameters that the optimizer updates."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.zero.host_memory import HostArena
from slipstream.zero.layout import ShardSpec
from slipstream.zero.norms import LandedSquares

__all__ = ["ShardedMasterWeights"]


class ShardedMasterWeights:
    """One fp32 ``nn.Parameter`` per trainable parameter, holding only this rank's shard.

    The optimizer is pointed at these shards (:meth:`swap_into`), so its states (Adam's two
    moments, ...) are allocated for the shard alone: that is ZeRO stage 1's saving. Their
    ``.grad`` receives the reduce-scattered, averaged gradient (fp32). A shard that is
    already an fp32 tensor (stage 3 in fp32) is used in place, not copied.

    Elementwise optimizers (SGD, Adam/AdamW, Lion, Adagrad, ...) give the same update on a
    shard as on the whole tensor; optimizers that take per-tensor norms (LAMB, LARS) see
    shard norms instead, as in DeepSpeed.

    ``device``: where the masters live (default: with their shards). CPU offload puts them in
    host memory (page-locked with ``pin``, when a GPU is present), together with their
    gradients, which :meth:`add_grad_` then receives from the device. ``share=False`` always
    copies (NVMe offload swaps the masters out, so they must not be the model's shards).
    ``offloaded`` (partial offload, ``offload_optimizer.ratio``): per parameter, whether its
    master goes to ``device``; one that does not is an fp32 copy on ``kept_device`` (default:
    its shard's device, the GPU) and steps there.

    Pinned host tensors of the offload path that live for the whole run (masters, the
    gradient landing buffers, staging copies: see :meth:`host_empty`) come from one :class:`~slipstream.zero.host_memory.HostArena`, at
    their exact size; ``own_storage`` gives each master a storage of its own instead (NVMe
    offload frees and re-allocates the masters' storages as it swaps them).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        specs: Sequence[ShardSpec],
        shards: Sequence[torch.Tensor],
        *,
        device: torch.device | None = None,
        pin: bool = False,
        share: bool = True,
        own_storage: bool = False,
        offloaded: Sequence[bool] | None = None,
        kept_device: torch.device | None = None,
    ) -> None:
        self.params = list(params)
        self.specs = list(specs)
        self.masters: list[torch.nn.Parameter] = []
        self.pin = pin and torch.cuda.is_available()
        moved = device is not None and device.type == "cpu"
        self.offloaded = list(offloaded) if offloaded is not None else [moved] * len(shards)
        if len(self.offloaded) != len(shards):
            raise ValueError(f"offloaded has {len(self.offloaded)} flags for {len(shards)} shards")
        # Masters and their grads, in fp32, are most of what the offload path pins.
        expected = 8 * sum(s.numel() for s, out in zip(shards, self.offloaded) if out)
        self.host = HostArena(self.pin, expected_bytes=expected)
        for shard, out in zip(shards, self.offloaded):
            if moved and not out:  # partial offload: this master stays on the device
                where = kept_device if kept_device is not None else shard.device
                kept = torch.empty(shard.shape, dtype=torch.float32, device=where)
                kept.copy_(shard.detach())
                self.masters.append(torch.nn.Parameter(kept, requires_grad=True))
                continue
            target = device if device is not None else shard.device
            if share and shard.dtype == torch.float32 and shard.device == target and not self.pin:
                data = shard
            elif self.pin and target.type == "cpu" and not own_storage:
                data = self.host.empty(shard.shape, torch.float32)
                data.copy_(shard.detach())
            else:
                data = torch.empty(
                    shard.shape, dtype=torch.float32, device=target, pin_memory=self.pin
                )
                data.copy_(shard.detach())
            self.masters.append(torch.nn.Parameter(data.detach(), requires_grad=True))
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        # Whether any master is in host memory (optimizer offload).
        self.on_host = moved and any(self.offloaded)
        # Offload: the global sum of squares of the grads, taken on the device by the reducer
        # while they were a single reduction (None: compute it from the host grads).
        self.device_squares: torch.Tensor | None = None
        # The same summed over the data-parallel group, when something already reduced it
        # (the speculative step's check at the end of backward); the step then reuses it.
        self.global_squares: torch.Tensor | None = None
        # This rank's sum of squares of the grads, taken by the reducer as the last reduction
        # before a step landed (None: the step takes it); see LandedSquares.
        self.landed_squares: LandedSquares | None = None
        # Offload: the device sums of squares of every reduction since zero_grad, added up
        # (gradient accumulation at stage 2: several reductions accumulate on the host). It is
        # not the norm of the accumulated grads, but it is non-finite whenever they are (an
        # fp32 sum a + b overflows only when |a| or |b| is past 1.7e38, whose square is inf),
        # so the non-finite vote rides on it instead of a pass over the host grads. None: not
        # every reduction since zero_grad left one.
        self.vote_squares: torch.Tensor | None = None
        # Offload with a bf16 reduction: a reduced gradient that landed on the host in bf16
        # and is the whole gradient of the step (a single reduction since zero_grad) stays
        # bf16 here instead of becoming an fp32 ``.grad`` (the C++ CPU step reads bf16
        # gradients, exactly widened; half the bytes over PCIe and through host memory).
        # :meth:`grad` and :meth:`has_grad` see both; :meth:`fp32_grad` widens one for good.
        self.landed: dict[int, torch.Tensor] = {}
        self._index_of_master = {id(m): i for i, m in enumerate(self.masters)}

    def __len__(self) -> int:
        return len(self.masters)

    def host_empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for the offload path, allocated once for the whole run: from the
        arena (exact size) when pinned."""
        return self.host.empty(shape, dtype)

    def swap_into(self, optimizer: torch.optim.Optimizer, strict: bool = True) -> None:
        """Make ``optimizer`` update the master shards instead of the model parameters.

        Its parameter groups (and their hyper-parameters) are kept; a frozen parameter in a
        group is dropped from it, since it never has a gradient. ``strict=False`` leaves a
        trainable parameter that is not one of ``params`` in place: several
        ShardedMasterWeights, each over its own group of ranks, can then share one optimizer
        (e.g. dense and expert parameters); the caller checks that every parameter was swapped.
        """
        if any(optimizer.state.values()):
            raise ValueError(
                "the optimizer already holds state (it has stepped): ZeRO must re-home it onto "
                "the parameter shards before the first step. Build the optimizer fresh and "
                "pass it to slipstream.initialize (or shard_optimizer) before training."
            )
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                index = self.index_of.get(id(p))
                if index is None:
                    if not p.requires_grad:
                        continue
                    if not strict:
                        swapped.append(p)
                        continue
                    raise ValueError(
                        "the optimizer holds a parameter that is not a trainable parameter of "
                        "the model; build the optimizer from model.parameters() (or param "
                        "groups of them)"
                    )
                swapped.append(self.masters[index])
            group["params"] = swapped

    def add_grad_(self, index: int, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced gradient shard (any float dtype) into master ``index``'s fp32 grad."""
        master = self.masters[index]
        if master.grad is None:
            # Not from the arena: a grad allocated after each zero_grad would grow it forever.
            pin = self.pin and master.device.type == "cpu"  # not a master kept on the GPU
            grad = torch.empty(
                master.shape, dtype=torch.float32, device=master.device, pin_memory=pin
            )
            grad.copy_(shard_grad)
            master.grad = grad
        else:
            master.grad.add_(shard_grad.to(master.device))

    def take_host_grad_(self, index: int, host: torch.Tensor, owned: bool) -> None:
        """Offload: a reduced shard already in host memory becomes (``owned``: a view of a
        buffer reserved for it) or is added into master ``index``'s fp32 grad. A bf16 one that
        is owned and the first since zero_grad is kept as it is (:attr:`landed`)."""
        if host.dtype != torch.float32 and owned and not self.has_grad(index):
            self.landed[index] = host
            return
        master = self.masters[index]
        if master.grad is None and index not in self.landed:
            if owned and host.dtype == torch.float32:
                master.grad = host
            else:
                master.grad = host.to(torch.float32, copy=True)
        else:
            self.fp32_grad(index).add_(host)

    def has_grad(self, index: int) -> bool:
        """Whether master ``index`` has a gradient (fp32 or landed)."""
        return self.masters[index].grad is not None or index in self.landed

    def grad(self, index: int) -> torch.Tensor | None:
        """Master ``index``'s gradient: its fp32 ``.grad``, or the landed bf16 one, or None."""
        grad = self.masters[index].grad
        return grad if grad is not None else self.landed.get(index)

    def grad_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """:meth:`grad` by master tensor (what the CPU step asks)."""
        return self.grad(self._index_of_master[id(master)])

    def fp32_grad(self, index: int) -> torch.Tensor:
        """Master ``index``'s gradient as its fp32 ``.grad`` (a landed bf16 one widened into a
        new tensor, exactly), zeros if it had none: for code that changes it in place."""
        master = self.masters[index]
        if master.grad is None:
            landed = self.landed.pop(index, None)
            master.grad = landed.float() if landed is not None else torch.zeros_like(master)
        return master.grad

    def grads(self) -> list[torch.Tensor]:
        """The master gradients that exist (every master after a full reduction); landed
        bf16 ones as they are."""
        grads = (self.grad(i) for i in range(len(self.masters)))
        return [g for g in grads if g is not None]

    def zero_grad(self) -> None:
        """Drop the master gradients."""
        for master in self.masters:
            master.grad = None
        self.landed.clear()
        self.device_squares = None
        self.global_squares = None
        self.landed_squares = None
        self.vote_squares = None
