"""2-GPU checks (``-m gpu``): Slipstream's symmetric-memory TP kernel against its reference and
against torch's one-shot kernel, eagerly, over many calls, in a CUDA graph and in a TP=2 engine."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _gathered(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts


def _check_kernel() -> None:
    from slipstream.inference.allreduce import TPReducer
    from slipstream.inference.allreduce_norm import reference, reference_sum

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.bfloat16, torch.float32):
        reducer = TPReducer(None)
        assert reducer.setup_symm_mem(device, dtype, 1 << 21, "slipstream") == ""
        assert reducer.norm_state is not None, reducer.norm_why
        torch.manual_seed(rank)
        weight = torch.randn(4096, device=device).to(dtype)
        for rows in (1, 7, 100):
            part = torch.randn(rows, 4096, device=device).to(dtype)
            residual = torch.full((rows, 4096), 0.5, device=device, dtype=dtype)
            parts = _gathered(part)
            assert torch.equal(reducer(part), reference_sum(parts)), (dtype, rows)
            total, normed = reducer.add_rms_norm(part, residual, weight, 1e-5)
            want_total, want_normed = reference(parts, residual, weight, 1e-5)
            assert torch.equal(total, want_total), (dtype, rows)
            torch.testing.assert_close(normed, want_normed, rtol=2e-2, atol=2e-2)
        # Many back-to-back calls (the flags are reused), then the same inside a CUDA graph.
        part = torch.randn(1, 4096, device=device).to(dtype)
        want = reference_sum(_gathered(part))
        outs = [reducer(part) for _ in range(300)]
        assert all(torch.equal(out, want) for out in outs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            reducer(part)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [reducer(part) for _ in range(64)]
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(out, want) for out in outs)
        assert int(reducer.norm_state.error.item()) == 0


def _check_engine() -> None:
    from slipstream.inference import init_inference
    from slipstream.inference.testing import tiny_hf_model

    model = tiny_hf_model("llama", layers=3)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    runs = {}
    for kernel in ("slipstream", "torch"):
        engine = init_inference(
            model,
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            enable_cuda_graph=True,
            max_out_tokens=32,
            tensor_parallel={"tp_size": 2, "allreduce": "symm_mem", "symm_mem_kernel": kernel},
        )
        reducer = engine.fused.blocks[0].reducer  # type: ignore[union-attr]
        assert (reducer.norm_state is not None) == (kernel == "slipstream"), reducer.norm_why
        logits = engine(ids).logits
        tokens = engine.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert engine._runner is not None and engine._runner.captured(2)
        runs[kernel] = (logits, tokens)
    torch.testing.assert_close(runs["slipstream"][0], runs["torch"][0], rtol=1e-4, atol=1e-4)
    assert torch.equal(runs["slipstream"][1], runs["torch"][1])


def _decode_steps(engine, ids: torch.Tensor, feed: torch.Tensor):
    """Prefill ``ids`` (batch 1), then one decode step per token of ``feed`` (teacher-forced,
    so that a near tie cannot send two runs apart) replayed from a CUDA graph: their logits."""
    from slipstream.inference.runner import StaticCacheRunner

    runner = StaticCacheRunner(engine.fused, 64, cuda_graph=True)
    length = ids.shape[1]
    positions = torch.arange(length, device=ids.device)[None]
    steps = []
    with torch.no_grad():
        runner.prefill(ids, positions, torch.ones_like(ids, dtype=torch.bool))
        for step, token in enumerate(feed):
            slot = length + step
            steps.append(runner.decode(token[None], torch.tensor([slot], device=ids.device), slot))
    assert runner.captured(1)
    return torch.stack(steps)


def _check_fused_sums() -> None:
    """The fused TP decode step (bf16: decode fusion's dtypes) in a CUDA graph: the defaults
    run it (the same logits bit for bit), and the unfused step is within a few bf16 steps."""
    from slipstream.inference import init_inference
    from slipstream.inference.fused_decode import PARTS
    from slipstream.inference.testing import tiny_hf_model

    model = tiny_hf_model("llama", layers=3)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2)).cuda()
    feed = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(3)).cuda()
    runs = {}
    for name, fusion in (("unfused", False), ("fused", True), ("defaults", "auto")):
        engine = init_inference(
            model,
            dtype=torch.bfloat16,
            replace_with_kernel_inject=True,
            max_out_tokens=64,
            decode_fusion=fusion,
            tensor_parallel={"tp_size": 2},
        )
        fused = engine.fused
        assert fused is not None
        if name != "unfused":
            assert fused.decode_fusion == PARTS
        state = fused.blocks[0].reducer.norm_state  # type: ignore[union-attr]
        assert state is not None
        runs[name] = _decode_steps(engine, ids, feed)
        assert int(state.error.item()) == 0, name
    assert torch.equal(runs["fused"], runs["defaults"])
    torch.testing.assert_close(runs["unfused"].float(), runs["fused"].float(), rtol=0.05, atol=0.1)


def _check_world() -> None:
    _check_kernel()
    _check_engine()


@pytest.mark.slow
def test_fused_decode_sums_on_two_gpus() -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run_distributed(_check_fused_sums, 2, backend="nccl", timeout=300)


@pytest.mark.slow
def test_symm_mem_kernel_on_two_gpus() -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run_distributed(_check_world, 2, backend="nccl", timeout=300)
