"""The reference ``rotary_embedding`` op against a complex-number formulation of RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.kernels.ops import rotary_embedding as dispatched_rotary_embedding
from slipstream.kernels.ops.rotary_embedding.reference import rotary_cos_sin, rotary_embedding

BATCH, SEQ, HEADS, HEAD_DIM = 2, 7, 3, 16
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def angles(positions: list[int], rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta[p, i] = p * base^(-2i / rotary_dim), in plain Python floats."""
    return torch.tensor(
        [[p * base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)] for p in positions],
        dtype=torch.float64,
    )


def complex_rope(x: torch.Tensor, theta: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate feature pairs as complex numbers z * e^{i theta}; x is (batch, seq, heads, dim).

    GPT-J pairs adjacent features (2i, 2i+1); GPT-NeoX pairs feature i with i + rotary_dim/2.
    """
    rotary_dim = 2 * theta.shape[-1]
    x64 = x.double()
    rotary, rest = x64[..., :rotary_dim], x64[..., rotary_dim:]
    if interleaved:
        pairs = rotary.reshape(*rotary.shape[:-1], rotary_dim // 2, 2)
    else:
        pairs = torch.stack((rotary[..., : rotary_dim // 2], rotary[..., rotary_dim // 2 :]), -1)
    z = torch.view_as_complex(pairs.contiguous())
    rotation = torch.polar(torch.ones_like(theta), theta)[None, :, None, :]  # (1, seq, 1, d/2)
    rotated = torch.view_as_real(z * rotation)
    if interleaved:
        out = rotated.flatten(-2)
    else:
        out = torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 10])  # full and partial rotary
def test_matches_complex_rotation(
    kernel_device: torch.device, interleaved: bool, rotary_dim: int
) -> None:
    # Built as (batch, heads, seq, dim) and viewed as (batch, seq, heads, dim): non-contiguous.
    x = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=kernel_device).transpose(1, 2)
    assert not x.is_contiguous()
    positions = list(range(5, 5 + SEQ))  # an offset, as when decoding after a prompt
    theta = angles(positions, rotary_dim)
    cos, sin = theta.cos().float().to(kernel_device), theta.sin().float().to(kernel_device)
    out = rotary_embedding(x, cos[:, None, :], sin[:, None, :], interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = complex_rope(x.cpu(), theta, interleaved)
    torch.testing.assert_close(out.cpu().double(), expected, **FP32)
    # Features past rotary_dim pass through untouched.
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_heads_before_sequence_layout(interleaved: bool) -> None:
    x = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)  # (batch, heads, seq, dim)
    theta = angles(list(range(SEQ)), HEAD_DIM)
    out = rotary_embedding(x, theta.cos().float(), theta.sin().float(), interleaved=interleaved)
    expected = complex_rope(x.transpose(1, 2), theta, interleaved).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, **FP32)


def test_rotation_preserves_pair_norms_and_position_zero_is_identity() -> None:
    x = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    cos, sin = rotary_cos_sin(4, 8, dtype=torch.float64)
    out = rotary_embedding(x, cos[:, None, :], sin[:, None, :])
    assert torch.equal(out[:, 0], x[:, 0])
    pair_norms = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norms(out), pair_norms(x), rtol=1e-12, atol=1e-12)


def test_bf16(kernel_device: torch.device) -> None:
    x = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, device=kernel_device, dtype=torch.bfloat16)
    theta = angles(list(range(SEQ)), HEAD_DIM)
    cos = theta.cos().to(kernel_device, torch.float32)[:, None, :]
    sin = theta.sin().to(kernel_device, torch.float32)[:, None, :]
    out = rotary_embedding(x, cos, sin)
    assert out.dtype == torch.bfloat16
    expected = complex_rope(x.cpu(), theta, interleaved=False)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2**-7, atol=2**-6)


def test_cos_sin_tables_match_the_formula() -> None:
    cos, sin = rotary_cos_sin(9, 12, base=500000.0)
    theta = angles(list(range(9)), 12, base=500000.0)
    assert cos.shape == (9, 6) and cos.dtype == torch.float32
    torch.testing.assert_close(cos.double(), theta.cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin.double(), theta.sin(), rtol=0, atol=1e-7)
    cos_at, _ = rotary_cos_sin(torch.tensor([3, 100000]), 4, dtype=torch.float64)
    expected = [[math.cos(p * 10000.0 ** (-2 * i / 4)) for i in range(2)] for p in (3, 100000)]
    torch.testing.assert_close(cos_at, torch.tensor(expected, dtype=torch.float64))


def test_gradients() -> None:
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rotary_cos_sin(3, 6, dtype=torch.float64)
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(
            lambda t, i=interleaved: rotary_embedding(t, cos[:, None], sin[:, None], interleaved=i),
            (x,),
        )


def test_dispatch_and_errors() -> None:
    x = torch.randn(1, 3, 2, 8)
    cos, sin = rotary_cos_sin(3, 8)
    assert torch.equal(
        dispatched_rotary_embedding(x, cos[:, None], sin[:, None], interleaved=True),
        rotary_embedding(x, cos[:, None], sin[:, None], interleaved=True),
    )
    with pytest.raises(ValueError, match="must have the same shape"):
        rotary_embedding(x, cos, sin[:, :2])
    wide_cos, wide_sin = rotary_cos_sin(3, 10)
    with pytest.raises(ValueError, match=r"cover 10 features.*only 8"):
        rotary_embedding(x, wide_cos[:, None], wide_sin[:, None])
    with pytest.raises(ValueError, match="positive even number, got 7"):
        rotary_cos_sin(3, 7)
