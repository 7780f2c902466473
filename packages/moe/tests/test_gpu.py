"""MoE on real GPUs: no host sync in drop mode, expert parallelism over NCCL (never runs in CI)."""

from __future__ import annotations

import pytest
import torch

from slipstream import comm
from slipstream.comm.testing import run_distributed
from slipstream.moe import FeedForwardExpert, MoE, allreduce_gradients, expert_parallel_state_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]

HIDDEN = 64


@pytest.mark.parametrize("k", [1, 2])
def test_drop_mode_forward_makes_no_host_sync(k):
    torch.manual_seed(0)
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 128), num_experts=8, k=k).cuda()
    x = torch.randn(4, 32, HIDDEN, device="cuda")
    layer(x)  # warm-up (lazy CUDA initialisation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        output, _, _ = layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert output.shape == x.shape


def _two_gpu_parity() -> float:
    rank = comm.get_rank()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 128), num_experts=4, k=2).cuda()
    with torch.no_grad():
        for param in reference.experts.parameters():
            param.normal_(std=0.2)  # distinct experts
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 128), num_experts=4, ep_size=2, k=2).cuda()
    layer.load_state_dict(expert_parallel_state_dict(reference.state_dict(), layer))
    comm.comms_logger.configure(enabled=True)

    def batch(r: int) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(10 + r)
        return torch.randn(64, HIDDEN, device="cuda", generator=generator)

    torch.manual_seed(100 + rank)
    output, l_aux, _ = layer(batch(rank))
    (output.square().mean() + 0.01 * l_aux).backward()
    allreduce_gradients(layer)
    worst = 0.0
    for replica in range(2):
        torch.manual_seed(100 + replica)
        ref_output, ref_aux, _ = reference(batch(replica))
        ((ref_output.square().mean() + 0.01 * ref_aux) / 2).backward()
        if replica == rank:
            torch.testing.assert_close(output, ref_output, rtol=1e-5, atol=1e-5)
            worst = float((output - ref_output).detach().abs().max())
    expected = expert_parallel_state_dict(
        {name: p.grad for name, p in reference.named_parameters()}, layer
    )
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "moe_dispatch" in comm.comms_logger.records
    return worst


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_over_nccl_matches_local_experts():
    run_distributed(_two_gpu_parity, 2, backend="nccl", timeout=180)
