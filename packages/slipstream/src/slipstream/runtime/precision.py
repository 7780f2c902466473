"""fp16/bf16 training with fp32 master weights, fp32 gradient accumulation and fp32 optimizer state."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MasterWeights:
    """fp32 copies of low-precision model parameters that the optimizer updates.

    Each micro-step's low-precision gradient is added into the master's fp32 ``.grad`` as soon
    as autograd produces it, and the low-precision ``.grad`` is dropped: accumulation over
    gradient-accumulation steps happens in fp32 (summing many bf16 gradients in bf16 loses
    bits) and no low-precision gradient outlives its backward pass.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.masters = [
            torch.nn.Parameter(
                p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad
            )
            for p in self.params
        ]

    def accumulate(self, index: int) -> None:
        """Move ``params[index].grad`` into the fp32 master gradient."""
        param, master = self.params[index], self.masters[index]
        grad = param.grad
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.to(torch.float32)
        else:
            master.grad.add_(grad)
        param.grad = None

    def copy_to_model(self) -> None:
        """Write the updated fp32 masters back into the low-precision parameters."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)

    def copy_from_model(self) -> None:
        """Refresh the masters from the model (after loading low-precision weights)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.copy_(param)

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` update the masters instead of the model parameters it was given."""
        by_id = {id(p): m for p, m in zip(self.params, self.masters)}
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) not in by_id:
                    if not p.requires_grad:
                        continue  # frozen: never has a gradient, so the optimizer skips it
                    raise ValueError(
                        "the optimizer holds a parameter that is not a trainable parameter of the "
                        "model; build the optimizer from model.parameters() (or param groups of them)"
                    )
                master = by_id[id(p)]
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                group["params"][i] = master
