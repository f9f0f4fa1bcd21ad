"""A CPU emulator of the torch_npu operators pdcluster calls, importable as `torch_npu` in tests.

Each emulated operator follows Ascend's documentation for it (argument names and defaults, shapes, dtypes,
layouts, return values) and raises the documented restrictions as RuntimeError, quoting the rule; the document
is cited in the operator's docstring. Documented features nobody here calls raise NotImplementedError, so a
caller never gets a silently wrong emulation. Math is float32; outputs have the input's dtype.

Devices. Real torch_npu renames PyTorch's privateuse1 backend to "npu" and allocates in device memory. The
emulator does not: the rename is process-wide and irreversible (a test could not uninstall it), and a
privateuse1 device needs a C++ allocator. So tensors stay on CPU and the emulated operators take CPU tensors;
a test runs the engine's NPU backend (its torch_npu calls, its layouts, its per-thread device binding) with
tensors on device "cpu". What is emulated of the device itself is the torch.cuda-like API at
`torch_npu.npu` (also set as `torch.npu`, as torch_npu does on import): is_available, device_count,
set_device, current_device, device, synchronize, mem_get_info, utilization, is_bf16_supported, Event, Stream, with
figures from `torch_npu._emulator`, and Ascend's per-thread device context: an operator called from a thread that
holds no context (never called set_device, and is not the thread that initialised the runtime) fails with "The context
is empty", as on hardware.

`torch_npu._emulator.npu_on_cpu = True` (or `emulated_torch_npu(npu_on_cpu=True)`) makes pdcluster take CPU tensors
for NPU ones (engine/device.py is_npu): `device="npu"` then builds an engine on CPU tensors that runs every NPU
code path, the fused operators below included (tests/test_npu_backend.py).

Emulated operators:
- npu_fused_infer_attention_score (attention.py)
- npu_scatter_pa_kv_cache, _npu_reshape_and_cache (kv_cache.py)
- npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_swiglu (layers.py)
- npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_grouped_matmul, npu_moe_finalize_routing (moe.py)
- _npu_paged_attention_mla (mla.py)
Next to this package, vllm_ascend/vllm_ascend_C.py emulates vLLM-Ascend's LoRA custom ops (bgmv_shrink, bgmv_expand,
sgmv_shrink, sgmv_expand in torch.ops._C_ascend), registered when engine/lora/npu_ops.py imports it.
Not emulated: HCCL (`torch_npu._C._distributed_c10d`), NZ formats (npu_format_cast), graph mode.

Install it with tests/npu_emulator.py (the `npu_emulator` fixture, or `emulated_torch_npu()`), which puts this
directory first on sys.path and removes the module and `torch.npu` afterwards.
"""

from __future__ import annotations

import torch

from torch_npu import _state as _emulator
from torch_npu import npu
from torch_npu.attention import npu_fused_infer_attention_score
from torch_npu.kv_cache import _npu_reshape_and_cache, npu_scatter_pa_kv_cache
from torch_npu.layers import npu_add_rms_norm, npu_rms_norm, npu_rotary_mul, npu_swiglu
from torch_npu.mla import _npu_paged_attention_mla
from torch_npu.moe import (
    npu_grouped_matmul,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k,
    npu_moe_init_routing_v2,
)

__version__ = "2.5.1.emulated"
EMULATED = True

torch.npu = npu

__all__ = [
    "EMULATED", "_emulator", "_npu_paged_attention_mla", "_npu_reshape_and_cache", "npu", "npu_add_rms_norm",
    "npu_fused_infer_attention_score", "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2", "npu_rms_norm", "npu_rotary_mul", "npu_scatter_pa_kv_cache", "npu_swiglu",
]
