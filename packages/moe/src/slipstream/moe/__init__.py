"""Mixture-of-Experts layers with expert parallelism (DeepSpeed's ``deepspeed.moe``).

>>> from slipstream.moe import MoE, FeedForwardExpert
>>> layer = MoE(hidden_size=512, expert=FeedForwardExpert(512, 2048), num_experts=8, ep_size=2, k=2)
>>> output, l_aux, exp_counts = layer(hidden_states)      # loss = task_loss + 0.01 * l_aux
>>> groups = split_params_into_different_moe_groups_for_optimizer(model)
>>> # after backward: dense grads over the world, expert grads over their expert-DP group
>>> allreduce_gradients(model)
"""

from __future__ import annotations

from slipstream.moe.all_to_all import all_to_all
from slipstream.moe.experts import (
    FeedForwardExpert,
    GatedFeedForwardExpert,
    GroupedFeedForwardExperts,
    GroupedGatedFeedForwardExperts,
    LocalExperts,
    LoopExperts,
    build_local_experts,
)
from slipstream.moe.gating import GateResult, TopKGate, compute_capacity, top_k_gating
from slipstream.moe.groups import (
    ExpertParallelGroups,
    expert_group_name,
    get_expert_data_parallel_group,
    get_expert_parallel_group,
    get_expert_parallel_groups,
    reset_expert_parallel_groups,
)
from slipstream.moe.hf import (
    ExpertParallelMixtralBlock,
    convert_mixtral_block,
    convert_mixtral_model,
)
from slipstream.moe.layer import MoE
from slipstream.moe.optim import (
    allreduce_gradients,
    clip_grad_norm_,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)
from slipstream.moe.state import expert_parallel_state_dict, full_state_dict

__all__ = [
    "ExpertParallelGroups",
    "ExpertParallelMixtralBlock",
    "FeedForwardExpert",
    "GateResult",
    "GatedFeedForwardExpert",
    "GroupedFeedForwardExperts",
    "GroupedGatedFeedForwardExperts",
    "LocalExperts",
    "LoopExperts",
    "MoE",
    "TopKGate",
    "all_to_all",
    "allreduce_gradients",
    "build_local_experts",
    "clip_grad_norm_",
    "compute_capacity",
    "convert_mixtral_block",
    "convert_mixtral_model",
    "expert_group_name",
    "expert_parallel_state_dict",
    "full_state_dict",
    "get_expert_data_parallel_group",
    "get_expert_parallel_group",
    "get_expert_parallel_groups",
    "is_moe_param",
    "reset_expert_parallel_groups",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
    "top_k_gating",
]
