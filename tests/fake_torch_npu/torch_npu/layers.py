"""Fused layer ops: `npu_rms_norm`, `npu_add_rms_norm`, `npu_rotary_mul`, `npu_swiglu`.

Each computes in float32 and returns its input's dtype, with the documented rounding points where a golden
reference pins them down (add_rms_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_npu import _state

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _fail(op: str, msg: str) -> None:
    raise RuntimeError(f"{op}: {msg}")


def _check_norm_inputs(op: str, x: torch.Tensor, gamma: torch.Tensor, x_name: str, min_dim: int) -> None:
    if x.dtype not in _FLOATS:
        _fail(op, f"{x_name}: dtype must be float16, bfloat16 or float32; got {x.dtype}")
    if gamma.dtype != x.dtype:
        _fail(op, f"gamma: dtype must be the same as {x_name}'s ({x.dtype}); got {gamma.dtype}")
    if not min_dim <= x.dim() <= 8:
        _fail(op, f"{x_name}: {min_dim}-8 dims are supported; got {x.dim()}")
    if gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        _fail(op, f"gamma {tuple(gamma.shape)} must be the last dims of {x_name} {tuple(x.shape)}")


def _rstd(x32: torch.Tensor, gamma_dims: int, epsilon: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the gamma dims, float32, shaped like x with those dims set to 1."""
    dims = tuple(range(x32.dim() - gamma_dims, x32.dim()))
    return torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """Follows Ascend/op-plugin docs/context/（beta）torch_npu-npu_rms_norm.md (hiascend ptaoplist "（beta）
    torch_npu.npu_rms_norm"): returns (y, rstd), y = x / Rms(x) * gamma, rstd = 1 / Rms(x) in float32 shaped
    like x with gamma's dims set to 1 (aclnnRmsNorm, hicann/ops-nn norm/rms_norm/docs). Rounding as the
    golden reference hicann/ops-nn norm/rms_norm/tests/assets/golden.py: all float32, y cast once. Raised:
    dtype other than float16/bfloat16/float32, gamma dtype different from self's, self outside 2-8 dims.
    """
    op = "npu_rms_norm"
    _state.record(op)
    _check_norm_inputs(op, self, gamma, "self", min_dim=2)
    x32 = self.float()
    rstd = _rstd(x32, gamma.dim(), epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follows aclnnAddRmsNorm (hicann/ops-nn norm/add_rms_norm/docs/aclnnAddRmsNorm_en.md) as torch_npu exposes
    it (Ascend/op-plugin test/test_custom_ops/test_npu_add_rms_norm.py: `y, rstd, x = npu_add_rms_norm(x1, x2,
    gamma, epsilon)`): x = x1 + x2, y = RmsNorm(x) * gamma, rstd float32. Rounding of Atlas A2/A3 (Ascend910B /
    Ascend910_93) as in golden.py's add_rms_golden_v1: x rounded to the input dtype first, x * rstd rounded to the
    input dtype before the gamma product (float16/bfloat16). Raised: dtypes other than float16/bfloat16/float32,
    x2 shape or dtype different from x1's, gamma dtype different or not x1's last dims, outside 1-8 dims.
    """
    op = "npu_add_rms_norm"
    _state.record(op)
    _check_norm_inputs(op, x1, gamma, "x1", min_dim=1)
    if x2.shape != x1.shape or x2.dtype != x1.dtype:
        _fail(op, f"x2 must have x1's shape and dtype ({tuple(x1.shape)}, {x1.dtype}); got {tuple(x2.shape)}, "
                  f"{x2.dtype}")
    dtype = x1.dtype
    x = (x1.float() + x2.float()).to(dtype)
    x32 = x.float()
    rstd = _rstd(x32, gamma.dim(), epsilon)
    normed = (x32 * rstd).to(dtype).float()
    return (normed * gamma.float()).to(dtype), rstd, x


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """Follows Ascend/op-plugin docs/context/torch_npu-npu_rotary_mul.md: output = r1 * input + r2 * rotate(input),
    rotate = cat(-x2, x1) of the two halves ("half") or of the even/odd elements ("interleave"); output shape and
    dtype of input. Raised: inputs not 4-D, dtypes other than float16/bfloat16/float32, rotary_mode other than
    half/interleave, D odd or >= 896, r1/r2 not broadcastable to input with input's D (half: 11SD/B1SD/BNSD for
    BNSD and the like; interleave: one non-1 dim besides D, e.g. 11SD / 1S1D / S11D).
    """
    op = "npu_rotary_mul"
    _state.record(op)
    if rotary_mode not in ("half", "interleave"):
        _fail(op, f"rotary_mode must be 'half' or 'interleave'; got {rotary_mode!r}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        if t.dim() != 4:
            _fail(op, f"{name}: a 4-D tensor is required; got {t.dim()} dims")
        if t.dtype not in _FLOATS:
            _fail(op, f"{name}: dtype must be float16, bfloat16 or float32; got {t.dtype}")
    d = input.shape[-1]
    if d % 2 or d >= 896:
        _fail(op, f"input: D must be a multiple of 2 and < 896; got {d}")
    for name, r in (("r1", r1), ("r2", r2)):
        if r.shape[-1] != d or any(rs not in (1, xs) for rs, xs in zip(r.shape[:3], input.shape[:3], strict=True)):
            _fail(op, f"{name} {tuple(r.shape)} does not broadcast to input {tuple(input.shape)}")
        if rotary_mode == "interleave" and sum(s != 1 for s in r.shape[:3]) > 1:
            _fail(op, f"{name}: interleave mode supports r layouts 11SD / 1S1D / S11D; got {tuple(r.shape)}")
    x32 = input.float()
    return (r1.float() * x32 + r2.float() * _rotate(x32, rotary_mode)).to(input.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Follows Ascend/op-plugin docs/context/（beta）torch_npu-npu_swiglu.md (hiascend ptaoplist "（beta）
    torch_npu.npu_swiglu"): input split in half along `dim`, A the first half, B the second,
    out = swish(A) * B = A * sigmoid(A) * B. Raised: 1-8 dims, the `dim` size not divisible by 2, dim outside
    [-input.dim(), input.dim() - 1], non-contiguous or empty input ("不支持非连续的Tensor，不支持空Tensor"),
    dtype other than float32/float16/bfloat16.
    """
    op = "npu_swiglu"
    _state.record(op)
    if input.dtype not in _FLOATS:
        _fail(op, f"input: dtype must be float32, float16 or bfloat16; got {input.dtype}")
    if not 1 <= input.dim() <= 8:
        _fail(op, f"input: 1-8 dims are supported; got {input.dim()}")
    if not -input.dim() <= dim < input.dim():
        _fail(op, f"dim must lie in [{-input.dim()}, {input.dim() - 1}]; got {dim}")
    if not input.is_contiguous():
        _fail(op, "input: non-contiguous tensors are not supported (不支持非连续的Tensor)")
    if input.numel() == 0:
        _fail(op, "input: empty tensors are not supported (不支持空Tensor)")
    if input.shape[dim] % 2:
        _fail(op, f"input: the size of dim {dim} must be divisible by 2; got {input.shape[dim]}")
    a, b = torch.chunk(input.float(), 2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)
