"""``tensor_parallel.gemv_push``: the fused TP decode step whose sums ride on its GEMVs, on CPU.

The GEMVs are Triton kernels run by Triton's interpreter (``TRITON_INTERPRET=1``, set for the
spawned ranks). Symmetric memory is emulated by one shared
file every rank maps: rank ``r``'s receive buffer is its ``r``-th part, and each rank addresses
its peers' parts in its own mapping, as it would address their buffers mapped over NVLink. So
the ranks are real processes (gloo for the other collectives) and the kernels' pushes and
polls cross between them as on GPUs.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")
pytest.importorskip("triton")

STEPS = 3  # greedy decode steps compared


def _push_state(path: str, model: Any, group: dist.ProcessGroup | None) -> Any:
    """This rank's PushState over the shared file (see the module docstring)."""
    from slipstream.inference.tp_decode import PushState
    from slipstream.kernels.ops.decode_gemv.triton import DecodeGemvConfig

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sites, region = 2 * len(model.blocks), model.spec.hidden_size
    per_rank = sites * world * region
    whole = torch.from_file(path, shared=True, size=world * per_rank, dtype=torch.int64)
    base = whole.data_ptr()
    pointers = torch.tensor([base + p * per_rank * 8 for p in range(world)], dtype=torch.int64)
    state = PushState(
        whole[rank * per_rank : (rank + 1) * per_rank], pointers, rank, world, sites, region
    )
    # Small tiles: several programs per GEMV and several K steps per row (the tiny model's
    # rows are 64 wide), so the pushes and pulls are split as on a GPU; at TP=2 the pulling
    # GEMVs keep the row in registers, at TP=4 the next weight tile is loaded ahead (the
    # kernel's variants).
    state.config = DecodeGemvConfig(block_n=16, block_k=32, prefetch=world == 4)
    state.row_in_registers = world == 2
    state.spin = 1 << 22
    return state


def _decode_steps(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` (batch 1), then STEPS greedy single-token steps: their logits, tokens."""
    from slipstream.inference.runner import StaticCacheRunner

    runner = StaticCacheRunner(model, 32, cuda_graph=False)
    length = ids.shape[1]
    with torch.no_grad():
        logits = runner.prefill(
            ids, torch.arange(length)[None], torch.ones_like(ids, dtype=torch.bool)
        )
        steps, tokens = [], []
        for step in range(STEPS):
            token = logits.argmax(-1)
            tokens.append(token)
            slot = length + step
            logits = runner.decode(token, torch.tensor([slot]), slot)
            steps.append(logits)
    return torch.stack(steps), torch.stack(tokens)


def _world(
    paths: dict[str, str], models: dict[str, Any], ids: torch.Tensor, expected: dict
) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set before the ranks were spawned
    from slipstream.inference.fused_decode import PARTS
    from slipstream.inference.tensor_parallel import shard_decoder

    rank = dist.get_rank()
    # TP=2 on two halves of the world at once (fp32 on one, bf16 on the other), then TP=4.
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    runs = [(("fp32", "bf16")[rank // 2], 2, halves[rank // 2]), ("bf16", 4, None)]
    for name, tp, group in runs:
        model = shard_decoder(copy.deepcopy(models[name]), group)
        model.decode_fusion = PARTS
        file = paths[f"{name}-{tp}-{rank // tp}"]
        model.tp_push = _push_state(file, model, group)
        dist.barrier()
        logits, tokens = _decode_steps(model, ids)
        want_logits, want_tokens = expected[name]
        assert int(model.tp_push.error.item()) == 0, (name, tp)
        assert int(model.tp_push.step.item()) == STEPS
        if name == "fp32":
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        else:  # bf16: the shards' partial sums round apart (and the interpreter rounds to
            # bf16 toward zero): a few bf16 steps of the logits
            torch.testing.assert_close(logits.float(), want_logits.float(), rtol=0.05, atol=0.1)
        assert torch.equal(tokens, want_tokens), (name, tp)
        dist.barrier()
    # Where the pushed sums cannot run, setup says why (the same answer on every rank).
    from slipstream.inference.tp_decode import setup_gemv_push

    group = halves[rank // 2]
    model = shard_decoder(copy.deepcopy(models["bf16"]), group)
    cpu = torch.device("cpu")
    assert setup_gemv_push(model, group, cpu) == "decode_fusion does not run every part"
    model.decode_fusion = PARTS
    assert setup_gemv_push(model, group, cpu) == "the model is on cpu, not CUDA"
    assert model.tp_push is None


@pytest.mark.slow
def test_gemv_push_decode_equals_single_rank(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 (fp32 and bf16) on two halves of 4 gloo ranks, and TP=4 (bf16): the pushed-sum
    fused decode steps' logits equal the single-rank unfused model's (fp32: within 1e-4; bf16:
    within a few bf16 steps) and the greedy tokens are the same."""
    from slipstream.inference import from_hf

    base = from_hf(tiny_hf_model("llama"))
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = {name: _decode_steps(model, ids) for name, model in models.items()}
    paths = {}
    sites, width = 2 * len(base.blocks), base.spec.hidden_size
    for key in ("fp32-2-0", "bf16-2-1", "bf16-4-0"):
        tp = int(key.split("-")[1])
        path = tmp_path / key
        path.write_bytes(bytes(8 * tp * sites * tp * width))  # every rank's buffer, zeroed
        paths[key] = str(path)
    # The ranks are spawned with the interpreter on (Triton reads it when triton.language is
    # imported); this process runs no kernel meanwhile and the setting is undone after.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_distributed(_world, 4, paths, models, ids, expected, timeout=600)
