"""``argmax``: the one-launch Triton kernel equals ``torch.argmax`` exactly (ties, NaN, -inf,
rows wider and narrower than a program's chunk, strided rows), and its arrival counters are
left at zero, so a captured CUDA graph replays it as captured."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.ops import argmax
from slipstream.kernels.ops.argmax.reference import argmax as reference


def _cases(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(shape, generator=generator) for shape in [(1, 5000), (3, 1024), (2, 7)]]
    ties = torch.zeros(2, 3000)
    ties[0, 2999] = ties[0, 5] = ties[0, 2048] = 1.0  # a tie across chunks: the first wins
    ties[1, 1500] = ties[1, 2500] = float("nan")  # a NaN beats +inf, the first NaN wins
    ties[1, 3] = float("inf")
    cases.append(ties)
    cases.append(torch.full((2, 2100), float("-inf")))  # every column -inf: index 0
    lone_nan = torch.full((1, 2100), float("-inf"))
    lone_nan[0, 2050] = float("nan")
    cases.append(lone_nan)
    return [case.to(device, dtype) for case in cases]


def test_reference_is_torch_argmax() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]])
    assert reference(scores).tolist() == [1, 0]
    with pytest.raises(ValueError, match="rows, columns"):
        reference(torch.zeros(3))


def test_triton_matches_torch(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.argmax.triton import argmax as triton_op
    from slipstream.kernels.triton_support import arrival_counters

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for scores in _cases(triton_device, dtype):
            assert torch.equal(triton_op(scores), scores.argmax(dim=-1)), (dtype, scores.shape)
    strided = torch.randn(4, 4000, device=triton_device)[:, ::2]
    assert torch.equal(triton_op(strided), strided.argmax(dim=-1))
    assert not arrival_counters("argmax", triton_device, 4).any()  # reset for the next launch


@pytest.mark.gpu
def test_dispatch_on_gpu_and_graph_replay() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    scores = torch.randn(1, 128256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax(scores), scores.argmax(dim=-1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(scores)
    for _ in range(3):
        scores.copy_(torch.randn_like(scores))
        graph.replay()
        assert torch.equal(out, scores.argmax(dim=-1))
