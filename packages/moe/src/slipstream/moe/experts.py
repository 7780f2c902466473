"""The experts a rank holds: standard FFN experts run as one batched matmul, any other module in a loop.

Every container takes ``(num_local_experts, tokens, hidden)`` and returns the same shape. Like
DeepSpeed, each local expert starts as a copy of the ``expert`` module given to the layer; the
routing makes them diverge. Parameters get DeepSpeed's markers, ``param.allreduce = False`` and
``param.group_name = "ep_size_<E>"``, which :mod:`slipstream.moe.optim` reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "FeedForwardExpert",
    "GatedFeedForwardExpert",
    "GroupedFeedForwardExperts",
    "GroupedGatedFeedForwardExperts",
    "LocalExperts",
    "LoopExperts",
    "build_local_experts",
    "make_activation",
]

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def make_activation(activation: str | nn.Module | Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """An activation module from a name (``relu``, ``gelu``, ``gelu_tanh``, ``silu``), or the
    module/callable itself."""
    if isinstance(activation, str):
        try:
            return _ACTIVATIONS[activation]()
        except KeyError:
            raise ValueError(
                f"unknown activation {activation!r}; use one of {sorted(_ACTIVATIONS)} or pass "
                "a module"
            ) from None
    if not callable(activation):
        raise TypeError(f"activation must be a name or a callable, got {activation!r}")
    return activation


class FeedForwardExpert(nn.Module):
    """The standard transformer FFN expert: ``fc2(activation(fc1(x)))``.

    Passed to :class:`slipstream.moe.MoE`, it runs as :class:`GroupedFeedForwardExperts` (one
    batched matmul over all local experts).

    >>> expert = FeedForwardExpert(hidden_size=16, ffn_hidden_size=64)
    >>> expert(torch.randn(3, 16)).shape
    torch.Size([3, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str | nn.Module = "gelu",
        bias: bool = True,
    ) -> None:
        """Two Linear layers, `hidden_size` → `ffn_hidden_size` → `hidden_size`."""
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.activation = make_activation(activation)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the FFN to the last dimension of `x`."""
        return self.fc2(self.activation(self.fc1(x)))


class GatedFeedForwardExpert(nn.Module):
    """A gated (SwiGLU-style) expert, as in Mixtral/Llama: ``down(act(gate(x)) · up(x))``.

    Runs as :class:`GroupedGatedFeedForwardExperts` inside :class:`slipstream.moe.MoE`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str | nn.Module = "silu",
        bias: bool = False,
    ) -> None:
        """Projections `hidden_size` → `intermediate_size` (gate and up) → `hidden_size`."""
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated FFN to the last dimension of `x`."""
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class LocalExperts(nn.Module):
    """Base of the expert containers: ``(experts, tokens, hidden)`` in and out."""

    num_local_experts: int

    def shard_full_state(
        self, prefix: str, full_state: Mapping[str, torch.Tensor], first_expert: int
    ) -> dict[str, torch.Tensor]:
        """This container's state, cut out of the state of a layer holding *all* experts.

        `prefix` is this module's key prefix in both state dicts; `first_expert` is the global
        index of local expert 0.
        """
        raise NotImplementedError  # each container knows its own layout


def _stack(tensor: torch.Tensor, copies: int) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone().unsqueeze(0).repeat(copies, *([1] * tensor.dim())))


class _StackedExperts(LocalExperts):
    """Experts whose parameters are stacked along a leading expert dimension."""

    def shard_full_state(
        self, prefix: str, full_state: Mapping[str, torch.Tensor], first_expert: int
    ) -> dict[str, torch.Tensor]:
        """Slice every stacked parameter of the full layer along its expert dimension."""
        shard = {}
        for name, _ in self.named_parameters(recurse=False):
            key = prefix + name
            if key not in full_state:
                raise KeyError(f"the full state has no {key!r}: is it the same architecture?")
            full = full_state[key]
            stop = first_expert + self.num_local_experts
            if full.shape[0] < stop:
                raise ValueError(
                    f"{key} holds {full.shape[0]} experts, fewer than the {stop} this rank needs"
                )
            shard[key] = full[first_expert:stop]
        return shard


class GroupedFeedForwardExperts(_StackedExperts):
    """All local :class:`FeedForwardExpert` s as stacked weights, run with two batched matmuls.

    Parameters (``n`` = local experts): ``fc1_weight (n, ffn, hidden)``, ``fc1_bias (n, ffn)``,
    ``fc2_weight (n, hidden, ffn)``, ``fc2_bias (n, hidden)`` (nn.Linear's layout per expert).
    """

    def __init__(self, expert: FeedForwardExpert, num_local_experts: int) -> None:
        """`num_local_experts` copies of `expert`'s weights."""
        super().__init__()
        self.num_local_experts = num_local_experts
        self.fc1_weight = _stack(expert.fc1.weight, num_local_experts)
        self.fc1_bias = (
            None if expert.fc1.bias is None else _stack(expert.fc1.bias, num_local_experts)
        )
        self.fc2_weight = _stack(expert.fc2.weight, num_local_experts)
        self.fc2_bias = (
            None if expert.fc2.bias is None else _stack(expert.fc2.bias, num_local_experts)
        )
        self.activation = copy.deepcopy(expert.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, tokens, hidden)`` → ``(n, tokens, hidden)``, expert ``i`` applied to ``x[i]``."""
        hidden = _batched_linear(x, self.fc1_weight, self.fc1_bias)
        return _batched_linear(self.activation(hidden), self.fc2_weight, self.fc2_bias)


class GroupedGatedFeedForwardExperts(_StackedExperts):
    """All local :class:`GatedFeedForwardExpert` s, gate and up projections fused in one matmul.

    Parameters: ``gate_up_weight (n, 2·inter, hidden)`` (gate rows first, then up rows, as
    Hugging Face's fused Mixtral experts store them), ``down_weight (n, hidden, inter)`` and,
    with bias, ``gate_up_bias`` and ``down_bias``.
    """

    def __init__(self, expert: GatedFeedForwardExpert, num_local_experts: int) -> None:
        """`num_local_experts` copies of `expert`'s weights."""
        super().__init__()
        self.num_local_experts = num_local_experts
        fused = torch.cat([expert.gate_proj.weight, expert.up_proj.weight], dim=0)
        self.gate_up_weight = _stack(fused, num_local_experts)
        self.down_weight = _stack(expert.down_proj.weight, num_local_experts)
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if expert.gate_proj.bias is not None and expert.up_proj.bias is not None:
            fused_bias = torch.cat([expert.gate_proj.bias, expert.up_proj.bias])
            self.gate_up_bias = _stack(fused_bias, num_local_experts)
        if expert.down_proj.bias is not None:
            self.down_bias = _stack(expert.down_proj.bias, num_local_experts)
        self.activation = copy.deepcopy(expert.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, tokens, hidden)`` → ``(n, tokens, hidden)``, expert ``i`` applied to ``x[i]``."""
        gate, up = _batched_linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return _batched_linear(self.activation(gate) * up, self.down_weight, self.down_bias)


def _batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x[i] @ weight[i].T + bias[i]`` for every expert ``i``, as one batched matmul."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


class LoopExperts(LocalExperts):
    """Arbitrary expert modules, run one after another (``local_experts[i]`` on ``x[i]``)."""

    def __init__(self, expert: nn.Module, num_local_experts: int) -> None:
        """`num_local_experts` deep copies of `expert`."""
        super().__init__()
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, tokens, hidden)`` → ``(n, tokens, hidden)``."""
        outputs = [expert(chunk) for expert, chunk in zip(self.local_experts, x.unbind(0))]
        return torch.stack(outputs, dim=0)

    def shard_full_state(
        self, prefix: str, full_state: Mapping[str, torch.Tensor], first_expert: int
    ) -> dict[str, torch.Tensor]:
        """Renumber ``local_experts.<first + i>.*`` of the full layer to ``local_experts.<i>.*``."""
        shard = {}
        for key in self.state_dict():
            index, _, rest = key[len("local_experts.") :].partition(".")
            source = f"{prefix}local_experts.{int(index) + first_expert}.{rest}"
            if source not in full_state:
                raise KeyError(f"the full state has no {source!r}: is it the same architecture?")
            shard[prefix + key] = full_state[source]
        return shard


def build_local_experts(
    expert: nn.Module, num_local_experts: int, grouped: bool = True
) -> LocalExperts:
    """The container for `num_local_experts` copies of `expert`: grouped (batched matmul) for
    :class:`FeedForwardExpert` and :class:`GatedFeedForwardExpert` when `grouped`, else a loop."""
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts={num_local_experts} must be >= 1")
    if grouped and type(expert) is FeedForwardExpert:
        return GroupedFeedForwardExperts(expert, num_local_experts)
    if grouped and type(expert) is GatedFeedForwardExpert:
        return GroupedGatedFeedForwardExperts(expert, num_local_experts)
    return LoopExperts(expert, num_local_experts)
