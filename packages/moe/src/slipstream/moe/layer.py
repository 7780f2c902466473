"""The MoE layer: gate, dispatch (all-to-all), local experts, combine (all-to-all), residual mix."""

from __future__ import annotations

import copy

import torch
from torch import nn

from slipstream.moe.all_to_all import all_to_all
from slipstream.moe.experts import LocalExperts, build_local_experts
from slipstream.moe.gating import GateResult, TopKGate
from slipstream.moe.groups import ExpertParallelGroups, get_expert_parallel_groups

__all__ = ["MoE"]


class MoE(nn.Module):
    """A Mixture-of-Experts layer with DeepSpeed's ``deepspeed.moe.layer.MoE`` arguments.

    ``forward(hidden_states)`` returns ``(output, l_aux, exp_counts)``: the output has the
    input's shape; add ``coefficient · l_aux`` (the load-balancing loss) to the training loss;
    ``exp_counts`` (``(num_experts,)`` int64) counts the assignments routed to each expert
    before dropping. Unlike DeepSpeed it stays on the device (no host sync): call ``.cpu()``
    where you log it.

    Args:
        hidden_size: input and output width.
        expert: the expert module; each of the ``num_experts / ep_size`` local experts starts
            as a copy. A :class:`~slipstream.moe.FeedForwardExpert` or
            :class:`~slipstream.moe.GatedFeedForwardExpert` runs all local experts in one
            batched matmul; any other module runs in a loop.
        num_experts: experts in this layer (layers may differ: PR-MoE).
        ep_size: ranks that the experts are sharded over (a divisor of the world size and of
            `num_experts`); the groups are created here, collectively (see
            :mod:`slipstream.moe.groups`).
        k: experts per token (1, 2 or more).
        capacity_factor: slots per expert, relative to an even split, in training.
        eval_capacity_factor: the same in eval mode.
        min_capacity: capacity floor when dropping.
        use_residual: Residual MoE: a dense copy of `expert` runs on every token and a learned
            ``Linear(hidden, 2)`` + softmax mixes it with the MoE output per token.
        noisy_gate_policy: None, ``"Jitter"`` (multiplicative noise on the gate input) or
            ``"RSample"`` (Gumbel-sampled expert choice); training only.
        drop_tokens: False is the no-drop mode: capacity becomes the largest per-expert count
            over the expert-parallel group, so every routed token is processed.
        use_rts: top-1 random token selection: an over-full expert keeps a random subset.
        top2_2nd_expert_sampling: top-2 samples its second expert in training (DeepSpeed's
            default); False takes the second-best.
        normalize_weights: renormalise a token's kept weights to sum to 1 (default: k >= 2).
        jitter_eps: the Jitter noise amplitude.
        grouped_experts: False forces the per-expert loop even for the standard FFN experts.

    In drop mode every rank of an expert-parallel group must pass the same number of tokens
    (the capacity, hence the all-to-all size, follows from it).

    >>> layer = MoE(16, FeedForwardExpert(16, 32), num_experts=4, k=2)
    >>> output, l_aux, exp_counts = layer(torch.randn(2, 5, 16))
    >>> output.shape, int(exp_counts.sum())
    (torch.Size([2, 5, 16]), 20)
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        *,
        top2_2nd_expert_sampling: bool = True,
        normalize_weights: bool | None = None,
        jitter_eps: float = 1e-2,
        grouped_experts: bool = True,
    ) -> None:
        """Build the gate and this rank's experts (see the class docstring)."""
        super().__init__()
        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"num_experts={num_experts} and ep_size={ep_size} must be >= 1")
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={ep_size}: every rank "
                "of an expert-parallel group holds the same number of experts"
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.k = k
        self.use_residual = use_residual
        self.groups: ExpertParallelGroups = get_expert_parallel_groups(ep_size)
        self.expert_group_name = self.groups.name
        self.first_local_expert = self.groups.ep_rank * self.num_local_experts

        self.gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
            normalize_weights=normalize_weights,
            jitter_eps=jitter_eps,
        )
        self.gate.ep_group = self.groups.ep_group
        self.experts: LocalExperts = build_local_experts(
            expert, self.num_local_experts, grouped=grouped_experts
        )
        for param in self.experts.parameters():
            # DeepSpeed's markers: not reduced with the dense parameters, but over the expert-DP
            # group named here.
            param.allreduce = False  # type: ignore[attr-defined]
            param.group_name = self.expert_group_name  # type: ignore[attr-defined]
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.last_gate: GateResult | None = None

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route, compute and combine; see the class docstring for what is returned.

        `used_token` (optional, one entry per token) excludes tokens where it is 0 from routing
        (their MoE output is zero).
        """
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE expects hidden size {self.hidden_size} in the last dimension, got input "
                f"of shape {tuple(hidden_states.shape)}"
            )
        tokens = hidden_states.reshape(-1, self.hidden_size)
        gate = self.gate(tokens, used_token)
        self.last_gate = gate
        output = self._experts_output(tokens, gate)
        if self.use_residual:
            dense = self.mlp(tokens)
            mix = torch.softmax(self.coefficient(tokens), dim=-1)
            output = output * mix[:, 0:1] + dense * mix[:, 1:]
        return output.reshape(hidden_states.shape), gate.l_aux, gate.exp_counts

    def _experts_output(self, tokens: torch.Tensor, gate: GateResult) -> torch.Tensor:
        num_tokens, hidden = tokens.shape
        capacity, k = gate.capacity, self.k
        num_slots = self.num_experts * capacity
        # Every (token, choice) gets a slot; dropped ones share one extra "trash" slot at the
        # end. Selecting only the kept ones (boolean indexing) would cost a device-to-host sync
        # per layer for the result's size; this keeps every shape known on the host.
        token_index = torch.arange(num_tokens, device=tokens.device).repeat_interleave(k)
        slots = gate.expert_index * capacity + gate.location
        slots = torch.where(gate.kept, slots, num_slots).reshape(-1)
        # Dispatch: each kept (token, choice) fills its own slot (kept slots are unique); empty
        # slots stay zero and the trash slot is cut off before the experts run.
        buffer = tokens.new_zeros(num_slots + 1, hidden)
        buffer = buffer.index_copy(0, slots, tokens.index_select(0, token_index))
        buffer = buffer[:num_slots].view(self.num_experts, capacity, hidden)

        expert_output = self._run_experts(buffer).reshape(num_slots, hidden)

        # Combine: each token sums its choices' outputs weighted by the gate (weight 0 and a
        # zero row for dropped choices).
        expert_output = torch.cat([expert_output, expert_output.new_zeros(1, hidden)])
        weights = gate.weights.reshape(-1, 1).to(tokens.dtype)
        picked = expert_output.index_select(0, slots) * weights
        return tokens.new_zeros(num_tokens, hidden).index_add(0, token_index, picked)

    def _run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """``(num_experts, capacity, hidden)`` → the same, each expert applied to its slots."""
        ep_size, local = self.ep_size, self.num_local_experts
        if ep_size == 1:
            return self.experts(buffer)
        _, capacity, hidden = buffer.shape
        # Rank r owns experts [r·local, (r+1)·local): dim 0 is already in rank order.
        received = all_to_all(buffer, self.groups.ep_group, "moe_dispatch")
        # (source rank, local expert, slot) -> (local expert, source rank · slot)
        expert_input = received.view(ep_size, local, capacity, hidden).transpose(0, 1)
        expert_output = self.experts(expert_input.reshape(local, ep_size * capacity, hidden))
        back = expert_output.view(local, ep_size, capacity, hidden).transpose(0, 1)
        returned = all_to_all(
            back.reshape(-1, capacity, hidden), self.groups.ep_group, "moe_combine"
        )
        return returned

    def extra_repr(self) -> str:
        """Layer sizes in ``print(model)``."""
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
            f"ep_size={self.ep_size}, k={self.k}, use_residual={self.use_residual}"
        )
