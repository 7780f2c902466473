"""``add_rms_norm`` and ``gated_activation``: references against the unfused torch steps, Triton
kernels against the references (the decoder block's residual + post-norm, and its SwiGLU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import add_rms_norm, gated_activation, rms_norm
from slipstream.kernels.ops.add_rms_norm.reference import add_rms_norm as add_rms_reference
from slipstream.kernels.ops.gated_activation.reference import (
    gated_activation as gated_reference,
)


def test_references_are_the_unfused_steps() -> None:
    x, r, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    total, normed = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(total, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-5), rtol=0, atol=0)
    up = torch.randn(2, 3, 32)
    for name, fn in [("silu", F.silu), ("relu", F.relu), ("gelu", F.gelu)]:
        expected = fn(up[..., :16]) * up[..., 16:]
        torch.testing.assert_close(gated_activation(up, name), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_reference(up, "swish")
    with pytest.raises(ValueError, match="must match"):
        add_rms_reference(x, r[:2], w)


def test_triton_matches_reference(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.add_rms_norm.triton import add_rms_norm as add_rms_triton
    from slipstream.kernels.ops.gated_activation.triton import gated_activation as gated_triton

    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for rows, cols in [(1, 96), (5, 40)]:
            x = torch.randn(rows, cols, generator=generator).to(triton_device, dtype)
            r = torch.randn(rows, cols, generator=generator).to(triton_device, dtype)
            w = torch.randn(cols, generator=generator).to(triton_device, dtype)
            total, normed = add_rms_triton(x, r, w, 1e-6)
            expected_total, expected_normed = add_rms_reference(x, r, w, 1e-6)
            # The sum is rounded exactly as torch's add; the norm is the same fp32 math in
            # another reduction order, rounded once.
            torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(normed, expected_normed, rtol=tol, atol=tol)
            up = torch.randn(rows, 2 * cols, generator=generator).to(triton_device, dtype)
            torch.testing.assert_close(
                gated_triton(up, "silu"), gated_reference(up, "silu"), rtol=tol, atol=tol
            )
            # Activations without a kernel run the reference.
            torch.testing.assert_close(gated_triton(up, "gelu"), gated_reference(up, "gelu"))


def test_moe_gemv(triton_device: torch.device) -> None:
    from slipstream.kernels.ops import moe_gemv
    from slipstream.kernels.ops.moe_gemv.reference import moe_gemv as reference
    from slipstream.kernels.ops.moe_gemv.triton import moe_gemv as triton_moe_gemv

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=generator)
    weights = torch.randn(4, 70, 200, generator=generator)
    experts = torch.tensor([3, 0, 3, 1, 2])
    expected = torch.stack([weights[e] @ x[r] for r, e in enumerate(experts.tolist())])
    torch.testing.assert_close(moe_gemv(x, experts, weights), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="K = 200"):
        reference(x[:, :100], experts, weights)
    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        args = (
            x.to(triton_device, dtype),
            experts.to(triton_device),
            weights.to(triton_device, dtype),
        )
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            triton_moe_gemv(*args).float(), reference(*args).float(), rtol=tol, atol=tol * 10
        )
