"""The emulator's state: what it accepts beyond the documented contract, and how often each API ran.

Tests configure it through `flashinfer._emulator` (this module) and read `calls` to check that a code path
really went through the emulated wrappers.
"""

from __future__ import annotations

import collections

import torch

# FlashInfer's attention and page kernels dispatch on float16 / bfloat16 (and fp8 KV); float32 fails to
# dispatch. True lets the tests run the FlashInfer path in float32, to compare it token for token with the
# float32 reference backends. Off by default, as on hardware.
allow_float32 = False

calls: collections.Counter[str] = collections.Counter()

HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def reset() -> None:
    global allow_float32
    allow_float32 = False
    calls.clear()


def q_dtypes() -> tuple[torch.dtype, ...]:
    return HALF_DTYPES + ((torch.float32,) if allow_float32 else ())


def kv_dtypes() -> tuple[torch.dtype, ...]:
    return q_dtypes() + FP8_DTYPES
