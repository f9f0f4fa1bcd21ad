"""Shared by the bf16 matmul tests (tests/test_bf16_gemv.py, tests/test_strips_gemm.py): the fp32-accumulated
reference and the bf16 rounding bound."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.attention import native

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler: native kernels not built")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """got within bf16 rounding (half an ulp: 2^-8 relative) of the exact product, plus fp32 summation error"""
    want = reference(x, w, bias)
    slack = 2 ** -8 * want.abs() + 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs() <= slack).all(), (got.double() - want).abs().max().item()
