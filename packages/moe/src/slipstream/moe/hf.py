"""Converting Hugging Face Mixtral-style sparse MoE blocks to expert-parallel :class:`MoE` layers.

Mixtral routes without capacity: softmax over all experts, the top-k, renormalised to sum to
one, every token processed. The converted layer uses the same rule (no-drop mode, no second-expert
sampling, ``normalize_weights=True``), so on one process it returns the block's output (to float
rounding) while its experts may be sharded over an expert-parallel group.

Two layouts are recognised by their attributes, not by importing transformers:

* transformers >= 5: ``block.gate.weight (E, hidden)``, ``block.experts.gate_up_proj
  (E, 2·inter, hidden)``, ``block.experts.down_proj (E, hidden, inter)``, ``block.experts.act_fn``;
  the block returns the hidden states.
* transformers 4.x: ``block.gate`` an ``nn.Linear``, ``block.experts`` a list of modules with
  ``w1`` (gate), ``w3`` (up), ``w2`` (down) and ``act_fn``; the block returns
  ``(hidden_states, router_logits)``.

Deviations: the router runs in float32 (Hugging Face computes the logits in the model's dtype, so
bf16 models may route a near-tie differently), and router jitter (``router_jitter_noise > 0``,
training only) perturbs the router's input only, where Hugging Face also scales the experts' input.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from slipstream.moe.experts import GatedFeedForwardExpert, GroupedGatedFeedForwardExperts
from slipstream.moe.layer import MoE

__all__ = ["ExpertParallelMixtralBlock", "convert_mixtral_block", "convert_mixtral_model"]


def _mixtral_weights(
    block: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, bool]:
    """(router weight, gate_up (E, 2I, H), down (E, H, I), activation, returns_router_logits)."""
    experts: Any = getattr(block, "experts", None)
    gate: Any = getattr(block, "gate", None)
    if experts is None or gate is None or not hasattr(gate, "weight"):
        raise TypeError(
            f"{type(block).__name__} does not look like a Mixtral sparse MoE block (it needs "
            "`gate` with a `weight` and `experts`)"
        )
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        return gate.weight, experts.gate_up_proj, experts.down_proj, experts.act_fn, False
    if isinstance(experts, nn.ModuleList) and all(
        hasattr(e, name) for e in experts for name in ("w1", "w2", "w3")
    ):
        members: list[Any] = list(experts)
        gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight], dim=0) for e in members])
        down = torch.stack([e.w2.weight for e in members])
        return gate.weight, gate_up, down, members[0].act_fn, True
    raise TypeError(
        f"{type(block).__name__}.experts has neither the fused layout (gate_up_proj, down_proj) "
        "nor a list of w1/w2/w3 experts; convert it by hand with slipstream.moe.MoE"
    )


class ExpertParallelMixtralBlock(nn.Module):
    """Drop-in replacement for a Mixtral sparse MoE block, backed by a :class:`MoE` layer.

    ``forward(hidden_states)`` returns what the original block returned (the hidden states, or
    ``(hidden_states, router_logits)`` for the transformers 4.x layout). The load-balancing
    loss and expert counts of the last call are kept in ``last_l_aux`` and ``last_exp_counts``.
    """

    def __init__(self, moe: MoE, top_k: int, return_router_logits: bool) -> None:
        """Wrap `moe` (already holding the block's weights)."""
        super().__init__()
        self.moe = moe
        self.top_k = top_k
        self.return_router_logits = return_router_logits
        self.last_l_aux: torch.Tensor | None = None
        self.last_exp_counts: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> Any:
        """The block's forward; see the class docstring."""
        output, self.last_l_aux, self.last_exp_counts = self.moe(hidden_states)
        if not self.return_router_logits:
            return output
        gate = self.moe.last_gate
        assert gate is not None  # set by every forward
        return output, gate.logits.to(hidden_states.dtype)


def convert_mixtral_block(
    block: nn.Module, ep_size: int = 1, *, grouped_experts: bool = True
) -> ExpertParallelMixtralBlock:
    """An expert-parallel copy of a Mixtral sparse MoE block (the block itself is not changed).

    With ``ep_size > 1`` (torch.distributed initialised) each rank keeps only its slice of the
    experts; every rank must convert the same blocks in the same order.

    >>> from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # doctest: +SKIP
    >>> converted = convert_mixtral_block(block, ep_size=2)  # doctest: +SKIP
    """
    router, gate_up, down, activation, returns_logits = _mixtral_weights(block)
    num_experts, hidden = router.shape
    intermediate = down.shape[-1]
    top_k = int(getattr(block, "top_k", getattr(block.gate, "top_k", 0)))
    if top_k < 1:
        raise TypeError(f"{type(block).__name__} has no top_k: cannot tell experts per token")
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    template = GatedFeedForwardExpert(hidden, intermediate, activation=copy.deepcopy(activation))
    moe = MoE(
        hidden,
        template,
        num_experts=num_experts,
        ep_size=ep_size,
        k=top_k,
        min_capacity=0,
        noisy_gate_policy="Jitter" if jitter > 0 else None,
        drop_tokens=False,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        normalize_weights=True,
        jitter_eps=jitter if jitter > 0 else 1e-2,
        grouped_experts=grouped_experts,
    )
    first, count = moe.first_local_expert, moe.num_local_experts
    with torch.no_grad():
        moe.gate.wg.weight.copy_(router.float())
        experts = moe.experts
        if isinstance(experts, GroupedGatedFeedForwardExperts):
            experts.gate_up_weight.data = gate_up[first : first + count].detach().clone()
            experts.down_weight.data = down[first : first + count].detach().clone()
        else:
            local: Any = experts.local_experts
            for index, expert in enumerate(local):
                fused = gate_up[first + index]
                expert.gate_proj.weight.data = fused[:intermediate].detach().clone()
                expert.up_proj.weight.data = fused[intermediate:].detach().clone()
                expert.down_proj.weight.data = down[first + index].detach().clone()
    moe.experts.to(device=down.device)
    moe.gate.to(device=router.device)
    moe.train(block.training)
    return ExpertParallelMixtralBlock(moe, top_k, returns_logits)


def convert_mixtral_model(
    model: nn.Module,
    ep_size: int = 1,
    *,
    block_class_names: tuple[str, ...] = ("MixtralSparseMoeBlock",),
    grouped_experts: bool = True,
) -> int:
    """Replace every Mixtral sparse MoE block inside `model` (in place); returns how many.

    Blocks are found by class name (`block_class_names`), so this works for Mixtral-shaped
    blocks of other models that use the same layout.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ in block_class_names
    ]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent, child, convert_mixtral_block(block, ep_size, grouped_experts=grouped_experts)
        )
    return len(targets)
