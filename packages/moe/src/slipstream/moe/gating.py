"""Top-k gating: expert choice, capacity, token dropping, the load-balancing loss (DeepSpeed's rules).

The gate works on a flat batch of ``S`` tokens and ``E`` experts. Each token picks ``k`` experts;
an expert takes at most ``capacity`` of the (token, choice) assignments routed to it and the rest
are dropped (their share of the output is zero). The result is kept sparse, as indices, rather than
DeepSpeed's dense ``(S, E, capacity)`` combine tensor: dispatch and combine then cost O(S·k·hidden)
instead of O(S·E·capacity·hidden). :meth:`GateResult.combine_weights` rebuilds the dense form.

[Note: which assignments an expert keeps]
Priority follows DeepSpeed. With ``k = 1`` and ``use_rts`` (random token selection) an expert keeps
a uniformly random subset of its tokens; otherwise first choices come before second choices, and
within one choice level earlier tokens come first (GShard's order). Kept assignments then take the
slots ``0, 1, ...`` of their expert in that order (choice level first, then token index).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream import comm

__all__ = ["NOISY_GATE_POLICIES", "GateResult", "TopKGate", "compute_capacity", "top_k_gating"]

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
"""Accepted values of ``noisy_gate_policy`` (DeepSpeed's; the string ``"None"`` also means None)."""


def compute_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int, k: int = 1
) -> int:
    """Slots per expert when dropping: ``max(ceil(tokens / experts · capacity_factor · k), min_capacity)``.

    >>> compute_capacity(10, 4, 1.0, 0)       # 2.5 tokens per expert, rounded up
    3
    >>> compute_capacity(10, 4, 1.0, 4)       # floored at min_capacity
    4
    >>> compute_capacity(16, 4, 1.5, 0, k=2)  # top-2 doubles the slots
    12
    """
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    capacity = math.ceil((num_tokens / num_experts) * (capacity_factor * k))
    return max(capacity, int(min_capacity))


@dataclasses.dataclass
class GateResult:
    """What the gate decided for ``S`` tokens, ``k`` choices each, over ``E`` experts.

    Attributes:
        expert_index: ``(S, k)`` int64, the expert of each choice (choice 0 is the first).
        location: ``(S, k)`` int64, the slot of each kept choice in its expert's buffer
            (meaningless where `kept` is False).
        kept: ``(S, k)`` bool, False for choices dropped over capacity or of unused tokens.
        weights: ``(S, k)`` float32, the combine weight of each choice (0 where dropped);
            differentiable with respect to the gate's logits.
        capacity: slots per expert (equal on every rank of the expert-parallel group).
        l_aux: the load-balancing loss, a float32 scalar.
        exp_counts: ``(E,)`` int64, assignments routed to each expert before dropping.
        num_experts: ``E``.
        logits: ``(S, E)`` float32, the gate logits the decision was made from (before any
            RSample noise).
    """

    expert_index: torch.Tensor
    location: torch.Tensor
    kept: torch.Tensor
    weights: torch.Tensor
    capacity: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    num_experts: int
    logits: torch.Tensor

    @property
    def num_dropped(self) -> torch.Tensor:
        """How many routed (token, choice) assignments were dropped over capacity."""
        return self.exp_counts.sum() - self.kept.sum()

    def combine_weights(self) -> torch.Tensor:
        """DeepSpeed's dense ``(S, E, capacity)`` combine tensor (memory-hungry: for tests and
        inspection; the layer itself uses the sparse form)."""
        num_tokens, k = self.expert_index.shape
        dense = self.weights.new_zeros(num_tokens, self.num_experts, self.capacity)
        tokens = torch.arange(num_tokens, device=self.weights.device)[:, None].expand(-1, k)
        kept = self.kept
        dense[tokens[kept], self.expert_index[kept], self.location[kept]] = self.weights[kept]
        return dense

    def dispatch_mask(self) -> torch.Tensor:
        """DeepSpeed's ``(S, E, capacity)`` bool dispatch mask: True where a token fills a slot."""
        num_tokens, k = self.expert_index.shape
        mask = torch.zeros(
            num_tokens, self.num_experts, self.capacity, dtype=torch.bool, device=self.kept.device
        )
        tokens = torch.arange(num_tokens, device=self.kept.device)[:, None].expand(-1, k)
        kept = self.kept
        mask[tokens[kept], self.expert_index[kept], self.location[kept]] = True
        return mask


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """int64 one-hot by scatter: ``F.one_hot`` validates its input on the host (a device sync)."""
    out = torch.zeros(*index.shape, num_classes, dtype=torch.int64, device=index.device)
    return out.scatter_(-1, index.unsqueeze(-1), 1)


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) samples shaped like `like` (for sampling an expert in proportion to softmax)."""
    uniform = torch.rand_like(like).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _choose_experts(
    logits: torch.Tensor,
    gates: torch.Tensor,
    k: int,
    rsample: bool,
    second_expert_sampling: bool,
) -> torch.Tensor:
    """The ``(S, k)`` experts chosen per token, best first."""
    if rsample:
        # RSample: pick by noisy logits (a Gumbel-max sample of the softmax); weights stay the
        # clean softmax.
        noisy = logits + _gumbel(logits)
        if k == 1:
            return noisy.argmax(dim=1, keepdim=True)
        return noisy.topk(k, dim=1).indices
    if k == 1:
        return gates.argmax(dim=1, keepdim=True)
    if k == 2 and second_expert_sampling:
        # DeepSpeed's top-2: the first expert is the argmax, the second is sampled from the
        # remaining ones in proportion to their softmax.
        first = gates.argmax(dim=1)
        noisy = (logits + _gumbel(logits)).scatter(1, first[:, None], float("-inf"))
        return torch.stack([first, noisy.argmax(dim=1)], dim=1)
    return gates.topk(k, dim=1).indices


def _positional_locations(
    expert_index: torch.Tensor, valid: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Slot of each valid assignment in priority order (choice level, then token index)."""
    num_tokens, k = expert_index.shape
    # Choice-major flattening: all first choices (in token order), then all second choices, ...
    flat_expert = expert_index.t().reshape(-1)
    flat_valid = valid.t().reshape(-1)
    one_hot = _one_hot(flat_expert, num_experts) * flat_valid[:, None].to(torch.int64)
    running = one_hot.cumsum(dim=0)
    location = (running * one_hot).sum(dim=1) - 1
    return location.reshape(k, num_tokens).t()


def _random_token_selection(
    expert_index: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """For top-1: which tokens each expert keeps, a uniformly random subset of at most `capacity`."""
    num_tokens = expert_index.shape[0]
    device = expert_index.device
    # Invalid (unused) tokens go to an extra bucket so that they take no expert's capacity.
    bucket = torch.where(valid[:, 0], expert_index[:, 0], num_experts)
    priority = torch.rand(num_tokens, device=device)
    by_priority = priority.argsort(descending=True)
    # Stable sort by bucket keeps the random order inside each bucket.
    order = by_priority[bucket[by_priority].argsort(stable=True)]
    # scatter_add rather than bincount, which syncs with the host to size its output.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    starts = counts.cumsum(0) - counts
    rank_in_bucket = torch.empty(num_tokens, dtype=torch.int64, device=device)
    rank_in_bucket[order] = torch.arange(num_tokens, device=device) - starts[bucket[order]]
    return (rank_in_bucket < capacity) & valid[:, 0]


def top_k_gating(
    logits: torch.Tensor,
    k: int = 1,
    *,
    capacity_factor: float = 1.0,
    min_capacity: int = 4,
    drop_tokens: bool = True,
    use_rts: bool = True,
    rsample: bool = False,
    second_expert_sampling: bool = False,
    normalize_weights: bool | None = None,
    used_token: torch.Tensor | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> GateResult:
    """Route ``S`` tokens to ``k`` of ``E`` experts from their ``(S, E)`` gate logits.

    Rules (DeepSpeed's ``top1gating`` / ``top2gating`` / ``topkgating``):

    * gates = softmax(logits); each token's choices are its top-k gates (see `rsample` and
      `second_expert_sampling` for the noisy variants).
    * capacity = :func:`compute_capacity` (S, E, capacity_factor, min_capacity, k) when
      `drop_tokens`; otherwise the largest per-expert count, agreed (max) across `ep_group`,
      so that nothing is dropped.
    * weights: the choice's gate; for ``k >= 2`` (or `normalize_weights`) divided by the sum
      of the token's *kept* choices' gates (a token whose second choice is dropped gives its
      first expert weight 1).
    * l_aux = E · Σ_e mean_gate_e · fraction_e, where fraction_e is the fraction of tokens whose
      first choice is e for ``k <= 2`` and the fraction of all assignments (divided by k) for
      ``k > 2``; it is 1 for a perfectly balanced router.

    Args:
        logits: ``(S, E)`` gate logits (computed in float32 by :class:`TopKGate`).
        k: experts per token.
        capacity_factor: slots per expert relative to a perfectly even split.
        min_capacity: lower bound of the capacity when dropping.
        drop_tokens: False is the no-drop mode (capacity grows to fit every assignment).
        use_rts: for ``k = 1``, keep a random subset of an over-full expert's tokens instead of
            the earliest ones (DeepSpeed applies it to top-1 only; so does this).
        rsample: choose experts by Gumbel-perturbed logits (``noisy_gate_policy="RSample"``).
        second_expert_sampling: for ``k = 2``, sample the second expert (DeepSpeed's
            ``top2_2nd_expert_sampling``).
        normalize_weights: renormalise the kept choices' weights to sum to 1; default: ``k >= 2``.
        used_token: optional ``(S,)`` mask; tokens where it is 0 are not routed at all.
        ep_group: the expert-parallel group over which the no-drop capacity is agreed.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and the number of experts ({num_experts})")
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    expert_index = _choose_experts(logits, gates, k, rsample, second_expert_sampling)

    if used_token is None:
        valid = torch.ones_like(expert_index, dtype=torch.bool)
    else:
        valid = (used_token.reshape(num_tokens, 1) != 0).expand(-1, k)
    one_hot = _one_hot(expert_index, num_experts) * valid[..., None].to(torch.int64)  # (S, k, E)
    exp_counts = one_hot.sum(dim=(0, 1))

    mean_gate = gates.mean(dim=0)
    if k <= 2:
        fraction = one_hot[:, 0, :].float().mean(dim=0)
        l_aux = torch.sum(mean_gate * fraction) * num_experts
    else:
        fraction = one_hot.sum(dim=1).float().mean(dim=0)
        l_aux = torch.sum(mean_gate * fraction) * num_experts / k

    if drop_tokens:
        capacity = compute_capacity(num_tokens, num_experts, capacity_factor, min_capacity, k)
    else:
        most = exp_counts.max().reshape(1)
        if ep_group is not None and comm.get_world_size(ep_group) > 1:
            comm.all_reduce(most, op=dist.ReduceOp.MAX, group=ep_group, log_name="moe_capacity")
        # Costly: a device-to-host sync, since the buffer shapes depend on this number.
        capacity = max(int(most.item()), 1)

    if drop_tokens and use_rts and k == 1:
        kept = _random_token_selection(expert_index, valid, num_experts, capacity)[:, None]
        location = _positional_locations(expert_index, kept, num_experts)
    else:
        location = _positional_locations(expert_index, valid, num_experts)
        kept = valid & (location < capacity)

    weights = gates.gather(1, expert_index) * kept
    if normalize_weights is None:
        normalize_weights = k >= 2
    if normalize_weights:
        denominator = weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
        weights = weights / denominator
    return GateResult(
        expert_index=expert_index,
        location=location.clamp(min=0),
        kept=kept,
        weights=weights,
        capacity=capacity,
        l_aux=l_aux,
        exp_counts=exp_counts,
        num_experts=num_experts,
        logits=logits,
    )


class TopKGate(torch.nn.Module):
    """The router: a float32 ``Linear(hidden, experts, bias=False)`` followed by :func:`top_k_gating`.

    Noise follows DeepSpeed and applies in training only: ``"Jitter"`` multiplies the gate's
    input by uniform noise in ``[1 - jitter_eps, 1 + jitter_eps]``; ``"RSample"`` chooses
    experts by Gumbel-perturbed logits. The capacity factor is `capacity_factor` in training
    and `eval_capacity_factor` in eval mode.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        *,
        top2_2nd_expert_sampling: bool = True,
        normalize_weights: bool | None = None,
        jitter_eps: float = 1e-2,
    ) -> None:
        """See :class:`slipstream.moe.MoE` for the arguments."""
        super().__init__()
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r} is not supported; use one of "
                "None, 'Jitter' or 'RSample'"
            )
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
        if min_capacity < 0 or capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor={capacity_factor}, eval_capacity_factor={eval_capacity_factor} "
                f"must be > 0 and min_capacity={min_capacity} >= 0"
            )
        self.wg = torch.nn.Linear(hidden_size, num_experts, bias=False).float()
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.normalize_weights = normalize_weights
        self.jitter_eps = jitter_eps
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None) -> GateResult:
        """Route ``tokens`` (``(S, hidden)``)."""
        # The gate runs in float32 even under autocast: routing decisions are discrete and
        # low-precision logits flip them.
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            gate_input = tokens.float()
            if self.training and self.noisy_gate_policy == "Jitter":
                noise = torch.empty_like(gate_input).uniform_(
                    1.0 - self.jitter_eps, 1.0 + self.jitter_eps
                )
                gate_input = gate_input * noise
            # .float() also covers a model cast to bf16/fp16 after construction.
            logits = F.linear(gate_input, self.wg.weight.float())
        return top_k_gating(
            logits,
            self.k,
            capacity_factor=self.capacity_factor if self.training else self.eval_capacity_factor,
            min_capacity=self.min_capacity,
            drop_tokens=self.drop_tokens,
            use_rts=self.use_rts,
            rsample=self.training and self.noisy_gate_policy == "RSample",
            second_expert_sampling=self.training and self.top2_2nd_expert_sampling,
            normalize_weights=self.normalize_weights,
            used_token=used_token,
            ep_group=self.ep_group,
        )
