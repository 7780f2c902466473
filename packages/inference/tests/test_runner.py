"""The static-shape decode step that CUDA graphs capture, run eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import from_hf
from slipstream.inference.generation import GenerationSettings, generate_tokens
from slipstream.inference.runner import StaticCacheRunner
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_cache_width_step_equals_eager_decode(family: str) -> None:
    """The captured step attends over all max_len slots (stale ones masked): same tokens."""
    model = from_hf(tiny_hf_model(family))
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    settings = GenerationSettings(max_new_tokens=10, pad_token_id=0)
    eager = StaticCacheRunner(model, 40, cuda_graph=False)
    expected = generate_tokens(eager.prefill, eager.decode, ids, mask, settings)

    static = StaticCacheRunner(model, 40, cuda_graph=False)
    # Stale garbage in the unused slots must not leak through the mask.
    bucket = static._bucket(3)
    bucket.cache.keys.normal_()
    bucket.cache.values.normal_()

    def graph_step(tokens: torch.Tensor, positions: torch.Tensor | None, slot: int) -> torch.Tensor:
        # positions None: the buffer the previous step advanced; the slot as the runner keeps it
        bucket.tokens = tokens[:, None].clone()
        if positions is not None:
            bucket.positions = positions[:, None].clone()
        bucket.slot, bucket.next_slot = torch.tensor([-1]), torch.tensor([slot])
        logits = static._graph_step(bucket)
        assert int(bucket.slot) == slot and int(bucket.next_slot) == slot + 1
        return logits

    tokens = generate_tokens(static.prefill, graph_step, ids, mask, settings)
    assert torch.equal(tokens, expected)


def test_moe_decode_path_equals_the_expert_loop() -> None:
    """The GPU decode path of a MoE layer (moe_gemv per (token, expert) row, no host sync),
    run here through the ops' torch references, equals the expert loop (fp32)."""
    from slipstream.inference import init_inference
    from slipstream.inference.testing import tiny_hf_model

    engine = init_inference(
        tiny_hf_model("mixtral"), dtype=torch.float32, replace_with_kernel_inject=True
    )
    assert engine.fused is not None
    moe = engine.fused.blocks[0].moe
    x = torch.randn(3, moe.router.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.softmax(moe.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(moe._decode(x, weights, experts), moe(x), rtol=1e-5, atol=1e-6)


def _steps(
    runner: StaticCacheRunner, ids: torch.Tensor, mask: torch.Tensor, graph: bool
) -> list[torch.Tensor]:
    """The prefill's and four decode steps' logits (greedy), each step through the runner's
    eager decode or, with ``graph``, the full-width step a CUDA graph captures."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = [runner.prefill(ids, positions, mask.bool())]
    bucket = runner._bucket(ids.shape[0])
    position, slot = positions[:, -1] + 1, ids.shape[1]
    for _ in range(4):
        tokens = logits[-1].argmax(-1)
        if graph:  # the captured step advances positions and the slot itself
            bucket.tokens = tokens[:, None].clone()
            if bucket.positions is None:
                bucket.positions = position[:, None].clone()
                bucket.slot, bucket.next_slot = torch.tensor([-1]), torch.tensor([slot])
            logits.append(runner._graph_step(bucket).float())
            assert int(bucket.slot) == slot and int(bucket.next_slot) == slot + 1
            assert torch.equal(bucket.positions[:, 0], position + 1)
        else:  # positions from the second step on: the runner's own (None)
            logits.append(runner.decode(tokens, position if slot == ids.shape[1] else None, slot))
        position, slot = position + 1, slot + 1
    return [*logits, bucket.key_valid.clone()]


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.float32), ("mistral", torch.bfloat16), ("opt", torch.bfloat16)],
)
def test_decode_prologue_changes_nothing(
    family: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through ``decode_inputs`` (the embedding, learned positions, rotary cos/sin
    from the runner's table, the additive GQA / sliding-window mask, the graph step's key-valid
    write) give the same logits, bit for bit, as the step-by-step torch prologue: eager and
    full-width (graph) steps, batch 2 with left padding, and again with the Triton kernel run
    by the interpreter for the llama case."""
    model = from_hf(tiny_hf_model(family)).to(dtype)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = []
    for prologue in (True, False):
        for graph in (False, True):
            runner = StaticCacheRunner(model, 24, cuda_graph=False)
            model.decode_prologue = prologue
            runs.append(_steps(runner, ids, mask, graph))
    expected = runs[2:]
    if family == "llama" and _interpreter():
        from slipstream.inference import model as model_module
        from slipstream.kernels.ops.decode_inputs.triton import decode_inputs as kernel

        monkeypatch.setattr(model_module, "decode_inputs", kernel)
        model.decode_prologue = True
        runs += [
            _steps(StaticCacheRunner(model, 24, cuda_graph=False), ids, mask, g)
            for g in (False, True)
        ]
        expected = expected * 2
    for got, want in zip(runs[:2] + runs[4:], expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert runs[1][-1][:, 7:11].all() and not runs[1][-1][:, 11:].any()


def _interpreter() -> bool:
    """Whether Triton kernels run here on the CPU, interpreted."""
    import importlib.util
    import os

    return importlib.util.find_spec("triton") is not None and (
        os.environ.get("TRITON_INTERPRET") == "1"
    )


def test_decode_prologue_kernel_under_the_interpreter() -> None:
    """The llama case above with the Triton ``decode_inputs`` kernel in the model, run by
    Triton's interpreter in a child (``TRITON_INTERPRET=1`` must be set before the kernel's
    module is imported)."""
    pytest.importorskip("triton")
    if _interpreter():
        pytest.skip("this process interprets already: the llama case ran the kernel")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    case = f"{__file__}::test_decode_prologue_changes_nothing[llama-dtype0]"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]
