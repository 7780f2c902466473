"""Ulysses sequence parallelism: DistributedAttention and the HF helper equal unsplit attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.comm.sequence import (
    DistributedAttention,
    SequenceParallelGrid,
    seq_all_to_all,
    sequence_parallel_cross_entropy,
    shard_sequence,
)
from slipstream.comm.testing import run_distributed


def _attend_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on [b, s, h, d] (GQA by repeating kv heads)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _attend_sbhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same on Megatron's [s, b, h, d] layout."""
    return _attend_bshd(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


def _check_attention(grid: SequenceParallelGrid, kv_heads: int, megatron: bool) -> None:
    sp, rank = grid.sequence_parallel_world_size, grid.sequence_parallel_rank
    generator = torch.Generator().manual_seed(kv_heads)
    b, s, h, d = 2, 8, 4, 3
    q = torch.randn(b, s, h, d, generator=generator, dtype=torch.float64)
    k = torch.randn(b, s, kv_heads, d, generator=generator, dtype=torch.float64)
    v = torch.randn(b, s, kv_heads, d, generator=generator, dtype=torch.float64)
    weight = torch.randn(b, s, h, d, generator=generator, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = _attend_bshd(*full)
    (reference * weight).sum().backward()

    window = slice(rank * s // sp, (rank + 1) * s // sp)
    local = [t[:, window].clone().requires_grad_() for t in (q, k, v)]
    if megatron:  # [s, b, h, d] with DeepSpeed's default indices
        layer = DistributedAttention(_attend_sbhd, grid.sequence_group)
        out = layer(*(t.transpose(0, 1) for t in local), batch_dim_idx=1).transpose(0, 1)
    else:
        layer = DistributedAttention(_attend_bshd, grid.sequence_group, 2, 1)
        out = layer(*local, batch_dim_idx=0)
    (out * weight[:, window]).sum().backward()
    torch.testing.assert_close(out, reference[:, window], rtol=1e-10, atol=1e-10)
    for mine, theirs in zip(local, full):
        assert theirs.grad is not None and mine.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad[:, window], rtol=1e-10, atol=1e-10)


def _tiny_llama(attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def _check_hf_llama(grid: SequenceParallelGrid) -> None:
    from slipstream.comm.sequence_hf import apply_ulysses_attention

    sp = grid.sequence_parallel_world_size
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = _tiny_llama("sdpa")
    ref_loss = reference(input_ids=tokens, labels=tokens).loss
    ref_loss.backward()

    model = apply_ulysses_attention(_tiny_llama("sdpa"), grid.sequence_group)
    piece = shard_sequence(tokens, tokens, grid.sequence_group)
    logits = model(input_ids=piece["input_ids"], position_ids=piece["position_ids"]).logits
    loss = sequence_parallel_cross_entropy(logits, piece["shift_labels"], grid.sequence_group)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=grid.sequence_group)
    # Hugging Face's loss (and this one) is taken in fp32 even for a float64 model.
    torch.testing.assert_close(mean / sp, ref_loss.detach(), rtol=1e-6, atol=0)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert mine.grad is not None and theirs.grad is not None, name
        grad = mine.grad.clone()
        dist.all_reduce(grad, group=grid.sequence_group)
        torch.testing.assert_close(grad / sp, theirs.grad, rtol=1e-6, atol=1e-9, msg=name)
    # Padding and missing positions are refused, not silently wrong.
    with pytest.raises(ValueError, match="padding"):
        mask = torch.ones_like(piece["input_ids"])
        mask[0, 0] = 0
        model(input_ids=piece["input_ids"], position_ids=piece["position_ids"], attention_mask=mask)
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=piece["input_ids"])


def _sequence_parallel_world() -> None:
    for sp in (2, 4):
        grid = SequenceParallelGrid(sp)
        assert grid.data_parallel_world_size == 4 // sp
        # MHA; GQA whose kv heads divide SP (or, at SP=4, are replicated); kv heads replicated.
        for kv_heads in (4, 2, 1):
            _check_attention(grid, kv_heads, megatron=False)
        _check_attention(grid, 2, megatron=True)
        _check_hf_llama(grid)
    grid = SequenceParallelGrid(4)
    with pytest.raises(ValueError, match="divides the number of attention heads"):
        DistributedAttention(_attend_bshd, grid.sequence_group, 2, 1)(
            *(torch.zeros(1, 2, 6, 2) for _ in range(3))
        )
    with pytest.raises(ValueError, match="key/value heads"):
        DistributedAttention(_attend_bshd, grid.sequence_group, 2, 1)(
            torch.zeros(1, 2, 12, 2), torch.zeros(1, 2, 6, 2), torch.zeros(1, 2, 6, 2)
        )
    # The all-to-all alone is its own inverse (sequence -> heads -> sequence).
    x = torch.randn(2, 4, 8, 3)
    back = seq_all_to_all(seq_all_to_all(x, 2, 1, grid.sequence_group), 1, 2, grid.sequence_group)
    torch.testing.assert_close(back, x, rtol=0, atol=0)


def test_ulysses_sp2_sp4_equal_unsplit_attention_and_hf_llama() -> None:
    run_distributed(_sequence_parallel_world, 4, timeout=240)


def test_grid_rejects_a_size_that_does_not_divide_the_world() -> None:
    with pytest.raises(ValueError, match="positive divisor"):
        SequenceParallelGrid(0)


def test_shard_sequence_shifts_labels_over_the_whole_sequence() -> None:
    tokens = torch.arange(8).view(1, 8)
    piece = shard_sequence(tokens, tokens, None)
    assert piece["shift_labels"].tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    assert piece["position_ids"].tolist() == [list(range(8))]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sp", "tp", "error"),
    [
        (8, 4, 2, 2, None),  # 4 local heads, 2 local kv heads: both split over SP=2
        (4, 2, 2, 2, None),  # 1 local kv head: replicated to the 2 SP ranks
        (8, 8, 4, 2, None),
        (4, 4, 4, 2, r"each rank's 2 attention heads \(of 4 after"),
        (12, 6, 2, 2, r"each rank has 3 key/value heads \(of 6 after"),
        (6, 6, 4, 1, r"splits each rank's 6 attention heads \(of 6\)"),
    ],
)
def test_check_ulysses_heads_per_tensor_parallel_rank(
    heads: int, kv_heads: int, sp: int, tp: int, error: str | None
) -> None:
    from slipstream.comm.sequence import check_ulysses_heads

    if error is None:
        check_ulysses_heads(heads, kv_heads, sp, tp)
    else:
        with pytest.raises(ValueError, match=error):
            check_ulysses_heads(heads, kv_heads, sp, tp)
