"""MLA decode on CUDA: FlashInfer's `BatchMLAPagedAttentionWrapper` (flashinfer-python v0.6.17,
https://docs.flashinfer.ai/api/mla.html) on the latent pool.

The wrapper takes the compressed KV and the rope key as two paged caches, ckv [num_pages, page_size, R] and kpe
[num_pages, page_size, P]; the pool's one row per token (c_kv then k_pe) is both, as two strided slices of the same
plane (the kernel reads each cache's page and token strides), so nothing is copied. The query is the absorbed
q_nope · W_UK ([B, N, R]) and q_pe ([B, N, P]); the output stays in latent space ([B, N, R]) for W_UV, as mla.py's
torch decode. Per step the decode rows' block tables become the wrapper's CSR page table (qo_indptr = 0..B,
kv_indptr, kv_indices, kv_len_arr, int32, built on the host) and it is planned once (`causal=False`: one query per
sequence, sm_scale the layer's scale) by whichever layer comes first; every layer then only runs. Wrapper and
workspace (128 MiB on cuda) are shared by all MLA layers on a device.

The kernel takes float16 / bfloat16 queries and KV and head dims in multiples of 64 (512 / 64 for DeepSeek): a
float32 model, an int8 latent pool and other shapes run mla.py's torch decode instead; so does a host where the
kernel cannot be built (logged once). The latent write and the expanded prefill are mla.py's torch ops.

Not run on a GPU here: tested on CPU tensors under the emulator in tests/fake_flashinfer (tests/test_mla_devices.py).
"""

from __future__ import annotations

import logging
import weakref
from itertools import accumulate

import torch

from pdcluster.engine.attention import flashinfer_backend
from pdcluster.engine.attention.mla import MLAAttentionBackend
from pdcluster.engine.attention.torch_backend import TorchAttentionMetadata

log = logging.getLogger(__name__)

HEAD_DIM_ALIGN = 64


class _SharedWrapper:
    """One device's MLA wrapper, its workspace and the step it was last planned for."""

    def __init__(self, fi, device: torch.device) -> None:
        size = (flashinfer_backend.CUDA_WORKSPACE_BYTES if device.type == "cuda"
                else flashinfer_backend.HOST_WORKSPACE_BYTES)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        self.planned: tuple[weakref.ref, tuple] | None = None


_shared: dict[tuple[torch.device, object], _SharedWrapper] = {}   # (device, the flashinfer module)


class FlashInferMLABackend(MLAAttentionBackend):
    name = "flashinfer"

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, scale)
        import flashinfer  # imported only when this backend is selected

        self.fi = flashinfer
        self.disabled: str | None = None   # why the kernel is unavailable (the torch decode runs instead)

    def kernel_takes(self, q: torch.Tensor, latent_cache: torch.Tensor) -> bool:
        return (self.disabled is None and q.dtype in flashinfer_backend.KERNEL_DTYPES
                and latent_cache.dtype == q.dtype and self.kv_lora_rank % HEAD_DIM_ALIGN == 0
                and self.qk_rope_head_dim % HEAD_DIM_ALIGN == 0)

    def decode(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """q [B, N, R + P] (absorbed, then q_pe) -> [B, N, R]."""
        if not self.kernel_takes(q, latent_cache):
            return super().decode(q, latent_cache, meta)
        r = self.kv_lora_rank
        try:
            wrapper = self._planned(meta, q, latent_cache)
            return wrapper.run(q[..., :r], q[..., r:], latent_cache[:, :, 0, :r], latent_cache[:, :, 0, r:])
        except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError):
            raise   # an argument FlashInfer refuses: a bug here
        except Exception as exc:   # the kernel could not be built or loaded on this host
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.error("flashinfer MLA: the kernel could not be built or loaded (%s): running the torch decode",
                      self.disabled)
            return super().decode(q, latent_cache, meta)

    def _planned(self, meta: TorchAttentionMetadata, q: torch.Tensor, latent_cache: torch.Tensor):
        """The device's wrapper, planned for this step's decode rows (once per step, by the first layer)."""
        device = latent_cache.device
        shared = _shared.get((device, self.fi))
        if shared is None:
            shared = _shared[(device, self.fi)] = _SharedWrapper(self.fi, device)
        block_size = latent_cache.shape[1]
        key = (self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, block_size, self.scale, q.dtype)
        if shared.planned is None or shared.planned[0]() is not meta or shared.planned[1] != key:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            assert tables is not None and lens is not None, "a step with decode rows"
            lens_host = lens.to("cpu", torch.int32)
            pages = [-(-n // block_size) for n in lens_host.tolist()]
            rows = tables.cpu()
            indices = torch.cat([rows[b, :p] for b, p in enumerate(pages)]).to(torch.int32)

            def host(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int32)
            shared.wrapper.plan(host(list(range(len(pages) + 1))), host([0, *accumulate(pages)]), indices, lens_host,
                                self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, block_size, False,
                                self.scale, q.dtype, latent_cache.dtype)
            shared.planned = (weakref.ref(meta), key)
        return shared.wrapper
