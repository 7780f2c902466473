"""NCCL on real GPUs: device selection, logged collectives, the launcher (never runs in CI)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream import comm
from slipstream.comm.distributed import free_port
from slipstream.comm.launcher import main
from slipstream.comm.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _nccl_collectives() -> dict:
    rank, n = comm.get_rank(), comm.get_world_size()
    assert torch.cuda.current_device() == comm.get_local_rank() == rank
    comm.configure(enabled=True)
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    comm.all_reduce(x)
    torch.testing.assert_close(x, torch.full_like(x, n * (n + 1) / 2))
    gathered = torch.empty(n * 4, device="cuda")
    comm.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device="cuda"))
    assert gathered.tolist() == [float(r) for r in range(n) for _ in range(4)]
    stats = comm.comms_logger.records["all_reduce"][4 << 20]
    return {"count": stats.count, "latency": stats.total_latency_s, "busbw": stats.busbw}


def test_nccl_collectives_on_local_devices() -> None:
    results = run_distributed(_nccl_collectives, 2, backend="nccl", timeout=120)
    for result in results:
        assert result["count"] == 1 and result["latency"] > 0 and result["busbw"] > 0


GPU_SCRIPT = """
import json, os, sys, torch
from slipstream import comm
comm.init_distributed()
t = torch.ones(8, device="cuda") * (comm.get_rank() + 1)
comm.all_reduce(t)
out = sys.argv[sys.argv.index("--out") + 1]
with open(os.path.join(out, f"rank{comm.get_rank()}.json"), "w") as handle:
    json.dump({"sum": t[0].item(), "device": torch.cuda.current_device(), "argv": sys.argv[1:],
               "backend": torch.distributed.get_backend()}, handle)
comm.destroy()
"""


def test_launcher_uses_every_gpu_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    roots = [os.path.dirname(path) for path in slipstream.__path__]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(roots))
    count = torch.cuda.device_count()
    assert main(["--dry_run", "train.py"]) == 0
    assert f"--nproc_per_node={count}" in shlex.split(capsys.readouterr().out)

    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(GPU_SCRIPT)
    out.mkdir()
    assert (
        main(["--num_gpus", "2", "--master_port", str(free_port()), str(script), "--out", str(out)])
        == 0
    )
    for rank in range(2):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record == {
            "sum": 3.0,
            "device": rank,
            "argv": [f"--local_rank={rank}", "--out", str(out)],
            "backend": "nccl",
        }


def _ulysses_on_nccl() -> float:
    """SP=2 DistributedAttention on [b, h, s, d] bf16 CUDA tensors (flash SDPA) vs unsplit."""
    import torch.nn.functional as F

    from slipstream.comm.sequence import DistributedAttention, SequenceParallelGrid

    grid = SequenceParallelGrid(2)
    rank = grid.sequence_parallel_rank
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, w = (
        torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(4)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=True)
    (reference.float() * w.float()).sum().backward()
    window = slice(rank * 512, (rank + 1) * 512)
    local = [t[:, :, window].clone().requires_grad_() for t in (q, k, v)]

    def attend(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    out = DistributedAttention(attend, grid.sequence_group, scatter_idx=1, gather_idx=2)(*local)
    (out.float() * w[:, :, window].float()).sum().backward()
    # The same kernel on the same whole-sequence rows per head: equal up to bf16 rounding.
    torch.testing.assert_close(out, reference[:, :, window], rtol=2e-2, atol=2e-2)
    worst = 0.0
    for mine, theirs in zip(local, full):
        assert mine.grad is not None and theirs.grad is not None
        diff = (mine.grad.float() - theirs.grad[:, :, window].float()).abs().max()
        worst = max(worst, float(diff / theirs.grad.float().abs().max()))
    return worst


def test_ulysses_sp2_on_nccl_matches_unsplit_attention() -> None:
    for worst in run_distributed(_ulysses_on_nccl, 2, backend="nccl", timeout=180):
        assert worst < 2e-2
