"""The engine with slipstream.moe layers: ep_size 1 trains like any model; expert parallelism is
refused clearly (the engine does not yet reduce expert gradients over their own groups)."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.comm.testing import run_distributed


class TinyMoEModel(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import FeedForwardExpert, MoE

        self.embed = nn.Linear(6, 8)
        self.moe = MoE(8, FeedForwardExpert(8, 16), num_experts=2, ep_size=ep_size, k=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, l_aux, _ = self.moe(self.embed(x))
        return nn.functional.cross_entropy(self.head(hidden), y) + 0.01 * l_aux


def _worker(ep_size: int) -> str:
    import slipstream
    from slipstream import comm

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    try:
        engine, *_ = slipstream.initialize(model=TinyMoEModel(ep_size), config=config)
    except NotImplementedError as error:
        return f"refused: {error}"
    g = torch.Generator().manual_seed(comm.get_rank())
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    engine.backward(engine(x, y))
    engine.step()
    weight = engine.module.moe.experts.parameters().__next__().detach().clone()
    gathered = [torch.zeros_like(weight) for _ in range(comm.get_world_size())]
    torch.distributed.all_gather(gathered, weight)
    return "agree" if torch.equal(gathered[0], gathered[1]) else "differ"


def test_moe_without_expert_parallelism_trains_and_expert_parallel_is_refused() -> None:
    assert run_distributed(_worker, 2, 1) == ["agree", "agree"]
    for message in run_distributed(_worker, 2, 2):
        assert message.startswith("refused:") and "expert-parallel" in message
