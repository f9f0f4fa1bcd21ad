"""The fused elementwise kernels (engine/layers/fused_ops.c) against torch's eager ops they replace in the layers:
the residual add and the rotary bit for bit, the RMSNorm and SiLU x up within rounding steps of the last bit
(summation order, exp polynomial); the vector path this CPU's build has (AVX-512 or AVX2), the AVX2 one built for
any CPU that runs it, and the plain C one; and the layers themselves with the kernels on and off."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from avx2_build import build_avx2, needs_avx2_cpu

from pdcluster.engine.attention import native
from pdcluster.engine.layers import layernorm, mlp, rotary

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler: native kernels not built")
PATHS = [pytest.param(False, id="vectorized"), pytest.param(True, id="portable")]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


def skip_unless_path(portable: bool) -> None:
    if not portable and not native._fused_vectorized():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the kernels decline every call but the plain C path's")


def one_step(dtype: torch.dtype) -> float:
    """What a different summation order or exp can move a result, relative: in bf16 a step of the last bit in the
    rounded intermediate (the norm before the weight, the SiLU before the product) and one in the result; in fp32 a
    few ulps (a sequential sum of hundreds of squares)."""
    return 2 ** -6 if dtype == torch.bfloat16 else 2 ** -17


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), w.shape, eps=eps).to(x.dtype)


def assert_within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.double() - want.double()).abs()
    assert (diff <= one_step(want.dtype) * want.double().abs() + 1e-30).all(), diff.max().item()


@needs_native
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 100), (70, 576), (5, 7)])
def test_rms_norm_matches_torch(portable: bool, dtype: torch.dtype, rows: int, hidden: int) -> None:
    skip_unless_path(portable)
    g = torch.Generator().manual_seed(rows * hidden)
    x, r = (torch.randn(rows, hidden, generator=g).mul(4).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    fused = native.rms_norm(x, w, 1e-5, portable=portable)
    assert fused is not None and fused[1] is None
    assert_within_one_step(fused[0], torch_rms_norm(x, w, 1e-5))
    fused = native.rms_norm(x, w, 1e-5, r, portable=portable)
    assert fused is not None and fused[1] is not None
    y, s = fused
    assert torch.equal(s, x + r)   # the residual stream: bit for bit
    assert_within_one_step(y, torch_rms_norm(x + r, w, 1e-5))


@needs_native
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (2, 37), (40, 1536)])
def test_silu_and_mul_matches_torch_on_strided_halves(portable: bool, dtype: torch.dtype, rows: int, n: int) -> None:
    skip_unless_path(portable)
    g = torch.Generator().manual_seed(rows * n)
    gate_up = torch.randn(rows, 2 * n, generator=g).mul(6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])   # sigmoid's ends and zero
    gate, up = gate_up.split(n, dim=-1)   # rows 2n apart
    got = native.silu_and_mul(gate, up, portable=portable)
    assert got is not None and got.is_contiguous()
    assert_within_one_step(got, F.silu(gate).mul(up))


@needs_native
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,d", [(1, 12, 64), (9, 5, 80), (300, 12, 64), (2, 3, 6)])
def test_rotary_is_bitwise_torch_on_a_qkv_view(portable: bool, dtype: torch.dtype, rows: int, heads: int,
                                               d: int) -> None:
    skip_unless_path(portable)
    g = torch.Generator().manual_seed(rows * heads * d)
    qkv = torch.randn(rows, (heads + 2) * d, generator=g).to(dtype)
    x = qkv[:, :heads * d].view(rows, heads, d)   # token rows (heads + 2) * d apart, as the attention layer's
    table = torch.randn(rows + 3, 2, d, generator=g).to(dtype)
    cos, sin = table[3:, :1], table[3:, 1:]   # [rows, 1, d], rows 2d apart
    half = d // 2
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    got = native.rotary(x, cos, sin, portable=portable)
    assert got is not None and torch.equal(got, want)


@needs_avx2_cpu
def test_the_avx2_build_matches_torch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUs with AVX2 and no AVX-512 take an 8-lane path (a row's last n % 8 values in plain C): built here for such
    a CPU whatever this one has, every case above through it."""
    lib = build_avx2(next(s for s in native.SOURCES if s.name == "fused_ops.c"), tmp_path / "fused.so")
    for name, argtypes in (("rms_norm", native._NORM_ARGTYPES), ("silu_and_mul", native._SILU_ARGTYPES),
                           ("rotary", native._ROTARY_ARGTYPES)):
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
    assert lib.fused_ops_vectorized() == 1
    monkeypatch.setattr(native, "load", lambda: lib)
    monkeypatch.setattr(native, "_fused_vectorized", lambda: True)
    for dtype in DTYPES:
        for rows, hidden in ((1, 576), (3, 100), (70, 576), (5, 7)):
            test_rms_norm_matches_torch(False, dtype, rows, hidden)
        for rows, n in ((1, 1536), (2, 37), (40, 1536)):
            test_silu_and_mul_matches_torch_on_strided_halves(False, dtype, rows, n)
        for rows, heads, d in ((1, 12, 64), (9, 5, 80), (300, 12, 64), (2, 3, 6), (4, 2, 36)):
            test_rotary_is_bitwise_torch_on_a_qkv_view(False, dtype, rows, heads, d)


@needs_native
def test_calls_the_kernels_do_not_take_are_declined() -> None:
    h = torch.randn(4, 64, dtype=torch.float16)
    assert native.rms_norm(h, torch.ones(64, dtype=torch.float16), 1e-6) is None   # fp16: torch's ops
    x = torch.randn(4, 64)
    assert native.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6) is None   # mixed dtypes
    assert native.rms_norm(x, torch.ones(32), 1e-6) is None                          # weight of another size
    assert native.rms_norm(x.t(), torch.ones(4), 1e-6) is None                      # not contiguous
    assert native.silu_and_mul(x, torch.randn(4, 32)) is None                        # shapes differ
    assert native.rotary(x.view(4, 1, 64), torch.ones(4, 1, 64), torch.ones(4, 1, 32)) is None      # cos, sin differ
    assert native.rotary(torch.randn(4, 2, 7), torch.ones(4, 1, 7), torch.ones(4, 1, 7)) is None   # odd head size


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_agree_with_their_torch_ops(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """RMSNorm (with and without a residual, with a bias), the MLP's SiLU x up and apply_rotary give what they
    give with the kernels off (PDCLUSTER_FUSED_OPS=0)."""
    g = torch.Generator().manual_seed(1)
    norm = layernorm.RMSNorm(96, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(96, generator=g))
    x, r = torch.randn(33, 96, generator=g).to(dtype), torch.randn(33, 96, generator=g).to(dtype)
    gate, up = torch.randn(33, 64, generator=g).to(dtype), torch.randn(33, 64, generator=g).to(dtype)
    qk = torch.randn(33, 4, 32, generator=g).to(dtype)
    cos, sin = torch.randn(33, 1, 32, generator=g).to(dtype), torch.randn(33, 1, 32, generator=g).to(dtype)

    def run() -> list[torch.Tensor]:
        plain, (summed_norm, summed) = norm(x), norm(x, r)
        norm.bias = torch.nn.Parameter(torch.randn(96, generator=torch.Generator().manual_seed(2)).to(dtype))
        biased = norm(x)
        norm.bias = None
        return [plain, summed_norm, summed, biased, mlp.silu_and_mul(gate.clone(), up),
                rotary.apply_rotary(qk, cos, sin)]

    fused = run()
    monkeypatch.setattr(native, "FUSED_OPS", False)
    reference = run()
    for got, want in zip(fused, reference, strict=True):
        assert_within_one_step(got, want)
    assert torch.equal(fused[2], reference[2]) and torch.equal(fused[5], reference[5])
