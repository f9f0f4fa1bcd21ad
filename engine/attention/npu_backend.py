"""Ascend slot in the attention registry.

Selecting it imports torch_npu (and only then). Today it runs the torch reference ops on NPU tensors;
the fused kernels (`torch_npu.npu_fused_infer_attention_score` for prefill/decode with block tables,
`torch_npu._npu_reshape_and_cache` for slot writes) replace `forward`/`write_kv` here. Not exercised on
Ascend hardware yet: see docs/engine.md.
"""

from __future__ import annotations

from pdcluster.engine.attention.torch_backend import TorchAttentionBackend


class NpuAttentionBackend(TorchAttentionBackend):
    name = "npu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import torch_npu  # noqa: F401  (imported only when this backend is selected)

        super().__init__(num_heads, num_kv_heads, head_dim)
