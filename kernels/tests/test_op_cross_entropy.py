"""The reference chunked ``cross_entropy`` op against torch.nn.functional.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import cross_entropy as dispatched_cross_entropy
from slipstream.kernels.ops.cross_entropy import reference
from slipstream.kernels.ops.cross_entropy.reference import cross_entropy

TOKENS, VOCAB = 37, 101  # odd sizes: chunks do not divide the tokens
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _targets(tokens: int, vocab: int, ignore_index: int, device: torch.device) -> torch.Tensor:
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[torch.rand(tokens, device=device) < 0.25] = ignore_index
    return target


@pytest.mark.parametrize("chunk_size", [1, 8, 64, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradient_match_torch(
    kernel_device: torch.device, chunk_size: int | None, reduction: str
) -> None:
    # Built as (vocab, tokens) and transposed: a non-contiguous input.
    logits = (torch.randn(VOCAB, TOKENS, device=kernel_device) * 4).t().requires_grad_()
    target = _targets(TOKENS, VOCAB, -100, kernel_device)
    expected_logits = logits.detach().clone().requires_grad_()

    loss = cross_entropy(logits, target, chunk_size=chunk_size, reduction=reduction)
    expected = F.cross_entropy(expected_logits, target, reduction=reduction)
    torch.testing.assert_close(loss, expected, **FP32)

    (loss * 3.0).backward()
    (expected * 3.0).backward()
    torch.testing.assert_close(logits.grad, expected_logits.grad, **FP32)


def test_batched_logits_and_custom_ignore_index(kernel_device: torch.device) -> None:
    logits = torch.randn(3, 11, 50, device=kernel_device, requires_grad=True)
    target = torch.randint(0, 50, (3, 11), device=kernel_device)
    target[0, :4] = 7  # ignore class 7 here: a real class id used as the ignore marker
    loss = cross_entropy(logits, target, ignore_index=7, chunk_size=5)
    reference_logits = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(reference_logits.reshape(-1, 50), target.reshape(-1), ignore_index=7)
    torch.testing.assert_close(loss, expected, **FP32)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad, **FP32)
    assert torch.count_nonzero(logits.grad[0, :4]) == 0  # ignored tokens get no gradient


def test_bf16_logits_are_upcast_per_chunk(kernel_device: torch.device) -> None:
    logits = (torch.randn(TOKENS, VOCAB, device=kernel_device) * 4).bfloat16().requires_grad_()
    target = _targets(TOKENS, VOCAB, -100, kernel_device)
    loss = cross_entropy(logits, target, chunk_size=6)
    assert loss.dtype == torch.bfloat16
    fp32_logits = logits.detach().float().requires_grad_()
    expected = F.cross_entropy(fp32_logits, target)
    torch.testing.assert_close(loss.float(), expected, rtol=2**-7, atol=0)
    loss.backward()
    expected.backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), fp32_logits.grad, rtol=2**-7, atol=1e-6)


def test_default_chunking_splits_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shrink the element budget so the default splits 37 tokens into chunks of 2 rows.
    monkeypatch.setattr(reference, "DEFAULT_CHUNK_ELEMENTS", 2 * VOCAB)
    logits = torch.randn(TOKENS, VOCAB, requires_grad=True)
    target = _targets(TOKENS, VOCAB, -100, torch.device("cpu"))
    seen_rows: list[int] = []
    original_logsumexp = torch.logsumexp
    monkeypatch.setattr(
        torch,
        "logsumexp",
        lambda t, dim: seen_rows.append(t.shape[0]) or original_logsumexp(t, dim),
    )
    loss = cross_entropy(logits, target)
    monkeypatch.undo()
    assert max(seen_rows) == 2 and sum(seen_rows) == TOKENS
    torch.testing.assert_close(loss, F.cross_entropy(logits.detach(), target), **FP32)


def test_backward_keeps_no_fp32_copy_of_the_logits() -> None:
    logits = torch.randn(TOKENS, VOCAB).bfloat16().requires_grad_()
    loss = cross_entropy(logits, torch.randint(0, VOCAB, (TOKENS,)), chunk_size=4)
    node = loss.grad_fn
    while not hasattr(node, "saved_tensors"):  # step past the cast back to bf16
        node = node.next_functions[0][0]
    full_size = [t for t in node.saved_tensors if t.numel() == TOKENS * VOCAB]
    assert [t.dtype for t in full_size] == [torch.bfloat16]  # only the caller's own logits
    assert sum(t.numel() for t in node.saved_tensors) < TOKENS * VOCAB + 4 * TOKENS + 1


def test_all_tokens_ignored_gives_nan_like_torch() -> None:
    logits = torch.randn(4, 9)
    target = torch.full((4,), -100)
    assert torch.isnan(cross_entropy(logits, target))
    assert torch.isnan(F.cross_entropy(logits, target))
    assert cross_entropy(logits, target, reduction="sum") == 0


def test_dispatch_and_errors() -> None:
    logits, target = torch.randn(6, 10), torch.randint(0, 10, (6,))
    assert torch.equal(dispatched_cross_entropy(logits, target), cross_entropy(logits, target))
    with pytest.raises(ValueError, match=r"logits \(6, 10\) must be target's shape \(5,\)"):
        cross_entropy(logits, target[:5])
    with pytest.raises(TypeError, match="integer class indices"):
        cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        cross_entropy(logits, target, chunk_size=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        cross_entropy(logits, target, reduction="none")
