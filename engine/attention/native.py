"""Builds and loads the CPU native kernels with the system C compiler: paged attention (paged_decode.c,
paged_prefill.c), the W8A16 and W8A8 matrix products (engine/quant/int8_gemv.c, int8_w8a8.c), the bf16
GEMV (engine/layers/bf16_gemv.c) and the fused elementwise ops (engine/layers/fused_ops.c), one library.

Compiled once per machine and source version (`-march=native`, so the key includes the CPU's flags)
into a user cache dir, then loaded with ctypes. Without a compiler, or if the build fails, `load()`
returns None and the CPU backend keeps the torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdcluster.device import row_size

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("paged_decode.c"), Path(__file__).with_name("paged_prefill.c"),
           Path(__file__).parent.parent / "quant" / "int8_gemv.c",
           Path(__file__).parent.parent / "quant" / "int8_w8a8.c",
           Path(__file__).parent.parent / "layers" / "bf16_gemv.c",
           Path(__file__).parent.parent / "layers" / "strips_gemm.c",
           Path(__file__).parent.parent / "layers" / "fused_ops.c"]   # one library
HEADERS = [Path(__file__).with_name("paged_simd.h")]   # included by every source; part of the build key
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# (q dtype, cache dtype) -> symbol; an int8 cache holds D int8 values + an fp16 scale per row (engine/kv_cache.py)
_SYMBOLS = {(torch.float32, torch.float32): "paged_decode_f32", (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
            (torch.float16, torch.float16): "paged_decode_f16", (torch.float32, torch.int8): "paged_decode_i8_f32",
            (torch.bfloat16, torch.int8): "paged_decode_i8_bf16", (torch.float16, torch.int8): "paged_decode_i8_f16"}
_PREFILL_SYMBOLS = {key: symbol.replace("paged_decode", "paged_prefill") for key, symbol in _SYMBOLS.items()}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64,
             ctypes.c_int]
INT8_BLOCK = 16   # BLOCK in int8_gemv.c: output channels per block of the packed weight
_INT8_X_TYPES = {torch.float32: 0, torch.bfloat16: 1}   # X_F32, X_BF16
_GEMM_ARGTYPES = [_ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int, ctypes.c_int]
_W8A8_ARGTYPES = [_ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, ctypes.c_int, ctypes.c_float,
                  ctypes.c_int, _ptr, ctypes.c_int, ctypes.c_int]
_BF16_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int, ctypes.c_int]
_STRIPS_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int, _i64, _ptr, _ptr, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int]
STRIP = 16   # output channels per strip of strips_gemm.c's layout
BF16_BLOCK = 64   # output channels per block of oneDNN's packed bf16 weight on AVX512-BF16 CPUs (BA16a64b2a)
# ... and the blocks tried, in order: 32 where the CPU has AMX (BA16a32b2a, inputs padded to a multiple of 32)
BF16_BLOCKS = (BF16_BLOCK, 32)
_NORM_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_SILU_ARGTYPES = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_ROTARY_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1}   # KIND_F32, KIND_BF16 (paged_simd.h)
# PDCLUSTER_FUSED_OPS=0 in the environment at import: the layers keep torch's elementwise ops (for A/B runs)
FUSED_OPS = os.environ.get("PDCLUSTER_FUSED_OPS", "1") != "0"
# PDCLUSTER_NATIVE_PREFILL=0 likewise: prefill chunks take the torch path (SDPA) instead of paged_prefill.c
NATIVE_PREFILL = os.environ.get("PDCLUSTER_NATIVE_PREFILL", "1") != "0"
_PREFILL_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64,
                     ctypes.c_int]


def cache_dir() -> Path:
    root = os.environ.get("PDCLUSTER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdcluster")
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"pdcluster-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine()


def _build(compiler: list[str], out: Path) -> None:
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([*compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, out)   # atomic: concurrent builders each install a complete file
    finally:
        tmp.unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    compiler = shlex.split(os.environ.get("CC", ""))
    if not compiler:
        found = shutil.which("cc") or shutil.which("gcc")
        compiler = [found] if found else []
    if not compiler:
        log.warning("no C compiler found: CPU decode attention uses the torch path (install gcc for the native kernel)")
        return None
    sources = [s.read_text() for s in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*sources, *compiler, *FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"paged_attention-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = str(getattr(e, "stderr", None) or e)
        log.warning("native CPU attention kernels unavailable, using the torch path: %s", detail.strip()[-2000:])
        return None
    for symbols, argtypes in ((_SYMBOLS, _ARGTYPES), (_PREFILL_SYMBOLS, _PREFILL_ARGTYPES),
                              ({"": "int8_gemm"}, _GEMM_ARGTYPES), ({"": "w8a8_gemm"}, _W8A8_ARGTYPES),
                              ({"": "bf16_gemm"}, _BF16_ARGTYPES), ({"": "strips_gemm"}, _STRIPS_ARGTYPES),
                              ({"": "strips_vector"}, []), ({"": "rms_norm"}, _NORM_ARGTYPES),
                              ({"": "silu_and_mul"}, _SILU_ARGTYPES), ({"": "rotary"}, _ROTARY_ARGTYPES)):
        for symbol in symbols.values():
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def int8_blocks(q: torch.Tensor) -> torch.Tensor:
    """The int8 weight q [n, k] in int8_gemv.c's layout: [ceil(n / 16), k rounded up to even, 16], block b holding
    output channels 16b .. 16b + 15 input by input (zero padded); the same bytes as q, give or take padding."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q, (0, k % 2, 0, -n % INT8_BLOCK))
    return padded.reshape(-1, INT8_BLOCK, k + k % 2).transpose(1, 2).contiguous()


def int8_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, portable: bool = False) -> torch.Tensor | None:
    """x [m, k] (fp32 or bf16) times the int8 weight q [n, k] packed by `int8_blocks`, with per-channel fp32
    `scales` [n]: [m, n] in x's dtype (engine/quant/int8_gemv.c); None without the native library.
    `portable`: the plain C path."""
    lib = load()
    fn = None if lib is None else getattr(lib, "int8_gemm", None)
    if fn is None:
        return None
    m, k = x.shape
    n = scales.shape[0]
    if not (x.dtype in _INT8_X_TYPES and x.is_contiguous() and w.dtype == torch.int8 and w.is_contiguous()
            and tuple(w.shape) == (-(-n // INT8_BLOCK), k + k % 2, INT8_BLOCK)
            and scales.dtype == torch.float32 and scales.is_contiguous()):
        raise ValueError("int8_gemm: x fp32/bf16 [m, k], w int8_blocks(q [n, k]) and fp32 scales [n], "
                         "all contiguous")
    y = torch.empty((m, n), dtype=x.dtype)
    if fn(x.data_ptr(), _INT8_X_TYPES[x.dtype], m, k, w.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
          torch.get_num_threads(), int(portable)) != 0:
        raise MemoryError("int8_gemm: could not allocate the activation buffer")
    return y


def w8a8_blocks(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight q [n, k] in int8_w8a8.c's layout, [ceil(n / 16), ceil(k / 4), 16, 4] (block b, group g:
    inputs 4g .. 4g + 3 of channels 16b .. 16b + 15, zero padded), and the int32 sums of q's rows [n]."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q, (0, -k % 4, 0, -n % INT8_BLOCK))
    blocks = padded.reshape(-(-n // INT8_BLOCK), INT8_BLOCK, (k + 3) // 4, 4).transpose(1, 2).contiguous()
    return blocks, q.to(torch.int32).sum(dim=1, dtype=torch.int32).contiguous()


def w8a8_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, wsum: torch.Tensor,
              bias: torch.Tensor | None = None, input_scale: float | None = None, input_offset: int = 0,
              portable: bool = False) -> torch.Tensor | None:
    """x [m, k] (fp32 or bf16), quantized to int8 in the call (per row, dynamic; or per tensor with `input_scale`
    and `input_offset`), times the int8 weight q [n, k] packed by `w8a8_blocks` (w, wsum), per-channel fp32
    `scales` [n], plus an optional fp32 `bias` [n]: [m, n] in x's dtype (engine/quant/int8_w8a8.c); None without
    the native library. `portable`: the plain C path."""
    lib = load()
    fn = None if lib is None else getattr(lib, "w8a8_gemm", None)
    if fn is None:
        return None
    m, k = x.shape
    n = scales.shape[0]
    if not (x.dtype in _INT8_X_TYPES and x.is_contiguous() and w.dtype == torch.int8 and w.is_contiguous()
            and tuple(w.shape) == (-(-n // INT8_BLOCK), -(-k // 4), INT8_BLOCK, 4)
            and scales.dtype == torch.float32 and scales.is_contiguous()
            and wsum.dtype == torch.int32 and wsum.is_contiguous() and wsum.shape == (n,)
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)))):
        raise ValueError("w8a8_gemm: x fp32/bf16 [m, k], w8a8_blocks(q [n, k]), fp32 scales [n] and bias [n], "
                         "all contiguous")
    if k == 0:   # (no inputs: the kernel's buffers would be empty)
        return (torch.zeros(m, n) if bias is None else bias.expand(m, n)).to(x.dtype)
    y = torch.empty((m, n), dtype=x.dtype)
    static = input_scale is not None
    if fn(x.data_ptr(), _INT8_X_TYPES[x.dtype], m, k, w.data_ptr(), scales.data_ptr(), wsum.data_ptr(), n,
          None if bias is None else bias.data_ptr(), int(static), float(input_scale or 1.0), int(input_offset),
          y.data_ptr(), torch.get_num_threads(), int(portable)) != 0:
        raise MemoryError("w8a8_gemm: could not allocate the activation buffer")
    return y


def bf16_blocks(w: torch.Tensor, block: int = BF16_BLOCK, kpad: int | None = None) -> torch.Tensor:
    """The bf16 weight w [n, k] in the layout bf16_gemv.c reads (oneDNN's BA16a64b2a for block 64, BA16a32b2a
    for 32):
    [ceil(n / block), kpad / 2, block, 2], block b holding output channels block * b .. block * (b + 1) - 1 input
    pair by input pair, zero padded (kpad: k rounded up to even by default)."""
    n, k = w.shape
    kpad = kpad or k + k % 2
    padded = torch.nn.functional.pad(w.detach(), (0, kpad - k, 0, -n % block))
    return padded.reshape(-1, block, kpad // 2, 2).transpose(1, 2).contiguous()


def bf16_gemm(x: torch.Tensor, w: int, n: int, block: int, kpad: int, bias: torch.Tensor | None = None,
              portable: bool = False) -> torch.Tensor | None:
    """x [m, k] bf16 times the bf16 weight W [n, k] packed as `bf16_blocks(W, block, kpad)` at address `w` (a
    oneDNN-packed weight's buffer, or a tensor's data_ptr; kept alive by the caller), plus an optional bf16 `bias`
    [n]: [m, n] bf16, fp32 sums rounded once (engine/layers/bf16_gemv.c); None without the native library.
    `portable`: the plain C path."""
    lib = load()
    fn = None if lib is None else getattr(lib, "bf16_gemm", None)
    if fn is None:
        return None
    m, k = x.shape
    if not (x.dtype == torch.bfloat16 and x.is_contiguous() and k <= kpad
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.shape == (n,)))):
        raise ValueError("bf16_gemm: x bf16 [m, k <= kpad] and bf16 bias [n], contiguous")
    y = torch.empty((m, n), dtype=torch.bfloat16)
    rc = fn(x.data_ptr(), m, k, w, block, kpad, None if bias is None else bias.data_ptr(), n, y.data_ptr(),
            torch.get_num_threads(), int(portable))
    if rc == -2:
        raise ValueError(f"bf16_gemm: no path for blocks of {block} channels, {kpad} inputs")
    if rc != 0:
        raise MemoryError("bf16_gemm: could not allocate the packed activations")
    return y


def strips_layout(w: torch.Tensor) -> torch.Tensor:
    """The weight w [n, k] in strips_gemm.c's layout, as a tensor of w's shape and dtype (the same bytes): strips of
    STRIP output channels input by input, w[s][i][c] = W[STRIP s + c][i], the last strip as wide as what is left."""
    n, k = w.shape
    full = n - n % STRIP
    head = w[:full].reshape(-1, STRIP, k).transpose(1, 2).reshape(-1)
    return torch.cat([head, w[full:].t().reshape(-1)]).reshape(n, k)


@functools.lru_cache(maxsize=1)
def strips_vector_level() -> int:
    """strips_gemm.c's path in this machine's build: 0 plain C (or no library), 1 AVX2 + FMA, 2 that on a CPU with
    AVX-512."""
    lib = load()
    return int(lib.strips_vector()) if lib is not None and hasattr(lib, "strips_vector") else 0


def strips_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                portable: bool = False) -> torch.Tensor | None:
    """x [m, k] (bf16 or fp32) times the weight W [n, k] (bf16 or fp32) packed by `strips_layout` (w), plus an
    optional `bias` [n]: [m, n] in x's dtype, fp32 sums rounded once (engine/layers/strips_gemm.c); None without
    the native library. `portable`: the plain C path."""
    lib = load()
    fn = None if lib is None else getattr(lib, "strips_gemm", None)
    if fn is None:
        return None
    m, k = x.shape
    n = w.shape[0]
    if not (x.dtype in _FLOAT_KINDS and w.dtype in _FLOAT_KINDS and w.is_contiguous() and w.shape[1] == k
            and (bias is None or bias.shape == (n,))):
        raise ValueError("strips_gemm: x [m, k] and w [n, k] bf16 or fp32, w contiguous, bias [n]")
    xf = x.float().contiguous() if x.dtype != torch.float32 or x.stride(-1) != 1 else x
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):   # (a layer's bias has its dtype)
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty((m, n), dtype=x.dtype)
    fn(xf.data_ptr(), xf.stride(0) if m > 1 else k, m, k, w.data_ptr(), _FLOAT_KINDS[w.dtype], n,
       None if bias is None else bias.data_ptr(), y.data_ptr(), _FLOAT_KINDS[x.dtype], torch.get_num_threads(),
       int(portable))
    return y


@functools.lru_cache(maxsize=1)
def _fused_vectorized() -> bool:
    lib = load()
    return lib is not None and hasattr(lib, "fused_ops_vectorized") and lib.fused_ops_vectorized() == 1


def _fused(name: str, portable: bool, *tensors: torch.Tensor | None):
    """The fused_ops.c function `name` if it takes these tensors (CPU, fp32 or bf16, all of one dtype, the last
    dimension contiguous) on this machine (its AVX-512 path, or `portable`: the plain C one), else None: the
    caller keeps its torch ops."""
    if not FUSED_OPS or not (portable or _fused_vectorized()):
        return None
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    if dtype not in _FLOAT_KINDS or any(t.device.type != "cpu" or t.dtype != dtype or t.stride(-1) != 1
                                        or t.requires_grad for t in present):
        return None
    lib = load()
    return None if lib is None else getattr(lib, name, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             portable: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight * norm(s), s) with s = x + residual (s None without a residual), x [..., H] as torch's eager
    `RMSNorm` computes it (engine/layers/fused_ops.c); None where the kernel does not apply."""
    fn = _fused("rms_norm", portable, x, weight, residual)
    if fn is None or not x.is_contiguous() or (residual is not None and not residual.is_contiguous()) \
            or weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        return None
    hidden = x.shape[-1]
    y = torch.empty_like(x)
    s = None if residual is None else torch.empty_like(x)
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), None if s is None else s.data_ptr(),
       weight.data_ptr(), y.data_ptr(), x.numel() // max(hidden, 1), hidden, eps, _FLOAT_KINDS[x.dtype],
       torch.get_num_threads(), int(portable))
    return y, s


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, portable: bool = False) -> torch.Tensor | None:
    """SiLU(gate) * up for gate, up [T, n] (rows may be strided: halves of one tensor), as `F.silu(gate).mul_(up)`
    (engine/layers/fused_ops.c); None where the kernel does not apply."""
    fn = _fused("silu_and_mul", portable, gate, up)
    if fn is None or gate.dim() != 2 or gate.shape != up.shape:
        return None
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype)
    fn(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, n,
       _FLOAT_KINDS[gate.dtype], torch.get_num_threads(), int(portable))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, portable: bool = False) -> torch.Tensor | None:
    """The rotate-half rotary embedding of x [T, heads, D] (token rows may be strided, a token's heads contiguous)
    with cos / sin [T, 1, D] (rows may be strided), as `x * cos + cat(-x2, x1) * sin` in torch
    (engine/layers/fused_ops.c): [T, heads, D] contiguous; None where the kernel does not apply."""
    fn = _fused("rotary", portable, x, cos, sin)
    if fn is None or x.dim() != 3 or cos.dim() != 3 or cos.shape != (x.shape[0], 1, x.shape[2]) \
            or sin.shape != cos.shape or sin.stride() != cos.stride() or x.stride(1) != x.shape[2] or x.shape[2] % 2:
        return None
    rows, heads, d = x.shape
    out = torch.empty((rows, heads, d), dtype=x.dtype)
    fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(), rows, heads, d,
       _FLOAT_KINDS[x.dtype], torch.get_num_threads(), int(portable))
    return out


def decode_kernel(dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """The compiled function for queries of `dtype` over a cache of `cache_dtype` (default: the same), or None
    (no compiler, build failed, dtypes not built)."""
    lib = load()
    symbol = _SYMBOLS.get((dtype, cache_dtype or dtype))
    return None if lib is None or symbol is None else getattr(lib, symbol, None)


def paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [B, Hq, D] (token rows may be strided); caches: a layer's [num_blocks, block_size, Hkv, row] caches with
    contiguous blocks (row = D, or D + 2 for an int8 cache); block_tables: [B, >= max blocks] int32 (rows may be
    strided; anything else is converted);
    context_lens: [B] int32; window > 0: attend to each row's last `window` tokens only. Returns [B, Hq, D]."""
    b, hq, d = q.shape
    _, bs, hkv, row = k_cache.shape
    if q.stride()[1:] != (d, 1) or k_cache.stride()[1:] != (hkv * row, row, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_decode: q heads and cache blocks must be contiguous")
    want_row = row_size(d, k_cache.dtype)
    if k_cache.dtype not in (q.dtype, torch.int8) or v_cache.dtype != k_cache.dtype or hq % hkv or row != want_row:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} {q.dtype} does not fit the cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 \
        else block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty((b, hq, d), dtype=q.dtype)
    rc = kernel(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                tables.stride(0), lens.data_ptr(), b, hq, hkv, d, bs, k_cache.stride(0), scale, window,
                torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode: could not allocate per-thread work buffers")
    return out


def prefill_kernel(dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """The compiled prefill function for queries of `dtype` over a cache of `cache_dtype`, or None. It may still
    decline a call (returns -2: neither AVX-512 nor AVX2, or a head size other than 64/128/256): `paged_prefill`
    then says so."""
    lib = load()
    symbol = _PREFILL_SYMBOLS.get((dtype, cache_dtype or dtype))
    return None if lib is None or symbol is None else getattr(lib, symbol, None)


@functools.lru_cache(maxsize=1)
def prefill_amx() -> bool:
    """Whether the bf16 prefill kernel runs its products on AMX tiles here (paged_prefill.c `paged_prefill_amx`:
    built for a CPU with AMX-BF16, and the kernel let the process use the tiles)."""
    lib = load()
    fn = None if lib is None else getattr(lib, "paged_prefill_amx", None)
    return fn is not None and fn() == 1


def paged_prefill(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  num_cached: int, scale: float, window: int = 0) -> torch.Tensor | None:
    """Causal attention of one prompt chunk: q [n, Hq, D] (token rows may be strided) at positions num_cached ..
    num_cached + n - 1, whose K/V (and the context's) are already in the caches (a layer's [num_blocks,
    block_size, Hkv, row] views) through `block_table` (int32 block ids of the sequence); window > 0: each row
    attends to its last `window` positions. Returns [n, Hq, D], or None where the kernel has no path for this
    shape (neither AVX-512 nor AVX2, head size not 64/128/256): the caller falls back to the torch path."""
    n, hq, d = q.shape
    _, bs, hkv, row = k_cache.shape
    if q.stride()[1:] != (d, 1) or k_cache.stride()[1:] != (hkv * row, row, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_prefill: q heads and cache blocks must be contiguous")
    if k_cache.dtype not in (q.dtype, torch.int8) or v_cache.dtype != k_cache.dtype or hq % hkv \
            or row != row_size(d, k_cache.dtype):
        raise ValueError(f"paged_prefill: q {tuple(q.shape)} {q.dtype} does not fit the cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    needed = -(-(num_cached + n) // bs)
    if block_table.numel() < needed:
        raise ValueError(f"paged_prefill: {block_table.numel()} blocks cannot hold {num_cached + n} positions")
    table = block_table if block_table.dtype == torch.int32 and block_table.is_contiguous() \
        else block_table.to(torch.int32).contiguous()
    out = torch.empty((n, hq, d), dtype=q.dtype)
    rc = kernel(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                num_cached, n, hq, hkv, d, bs, k_cache.stride(0), scale, window, torch.get_num_threads())
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("paged_prefill: could not allocate the packed K/V buffer")
    return out
