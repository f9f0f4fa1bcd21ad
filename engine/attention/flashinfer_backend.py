"""CUDA attention through FlashInfer (`flashinfer-python`): paged prefill and decode wrappers over the pool's
per-layer K and V caches, KV written by `flashinfer.append_paged_kv_cache`.

Per step (`prepare`, once, shared by every layer) the step's block tables become FlashInfer's CSR page tables
(`indptr`, `indices`, `last_page_len`, int32, built on the host — pinned on cuda — and copied once); on the first
layer that needs it, each wrapper is planned once per step and per sliding window (`window_left`, fixed at plan
time), and every layer then only `run`s. Decode rows (the first `num_decode_tokens` rows) go through
`BatchDecodeWithPagedKVCacheWrapper` (tensor cores for query groups > 4, as vLLM does), the prefill chunks through
one `BatchPrefillWithPagedKVCacheWrapper` plan with `causal=True`: FlashInfer aligns a chunk's queries with the
last positions of its KV, so a chunk after cached context (chunked prefill, prefix-cache hit) needs no mask. A
windowed plan lists each sequence's pages from the first one its window can see (released blocks are never
named) and sets `window_left = window - 1` (FlashInfer's window counts the keys left of the query; ours counts
the query too). GQA is the kernels' own (num_qo_heads a multiple of num_kv_heads).

Calls follow flashinfer-python v0.6.17's API (flashinfer/prefill.py, decode.py, page.py; docs.flashinfer.ai
/api/prefill.html, /api/decode.html, /api/page.html): options after `page_size` by keyword, index arrays int32.
FlashInfer's kernels take float16 / bfloat16 (and fp8) queries and KV: a float32 model and an int8 KV pool (its
scales inside each row) run the torch reference backend (`reference`) instead, with one warning. Not run on
a GPU here: tested on CPU tensors under the emulator in tests/fake_flashinfer (docs/engine.md "CUDA").
"""

from __future__ import annotations

import logging

import torch

from pdcluster.engine.attention.metadata import AttentionMetadata
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float16, torch.bfloat16)   # activations and KV FlashInfer's kernels are used for here
CUDA_WORKSPACE_BYTES = 128 << 20   # the docs' recommended float workspace (split-k partial results)
HOST_WORKSPACE_BYTES = 1 << 20     # off cuda (the emulator) nothing is kept in it


class FlashInferMetadata:
    """One step: the shared metadata, its page tables (built on the first layer, which knows the page size) and
    the plans made from them, one per (decode | prefill, window); the torch path's metadata when that runs."""

    def __init__(self, backend: "FlashInferAttentionBackend", meta: AttentionMetadata) -> None:
        self.backend = backend
        self.meta = meta
        self.num_decode_tokens = meta.num_decode_tokens
        self._tables: _PageTables | None = None
        self._plans: dict[tuple[str, int], object] = {}
        self._torch: TorchAttentionMetadata | None = None

    def torch_meta(self) -> TorchAttentionMetadata:
        if self._torch is None:
            self._torch = TorchAttentionBackend.prepare(self.meta)
        return self._torch

    def tables(self, page_size: int) -> "_PageTables":
        if self._tables is None:
            self._tables = _PageTables(self.meta, page_size, self.backend.fi)
        return self._tables

    def plan(self, kind: str, window: int, q: torch.Tensor, k_cache: torch.Tensor):
        """The wrapper for `kind` rows at `window`, planned for this step (once, whichever layer asks first)."""
        key = (kind, window)
        if key not in self._plans:
            self._plans[key] = self.backend.plan(kind, window, self.tables(k_cache.shape[1]), q.dtype, k_cache)
        return self._plans[key]


class _PageTables:
    """Each sequence of the step (decode rows, then prefill chunks, in row order) as FlashInfer's page tables,
    plus where each new token's K/V goes (`batch_indices`, `positions`, for append_paged_kv_cache)."""

    def __init__(self, meta: AttentionMetadata, page_size: int, fi) -> None:
        device = meta.slot_mapping.device
        self.page_size = page_size
        self.pin = device.type == "cuda"
        nd = meta.num_decode_tokens
        dec_lens, dec_tables, chunk_tables = _host_tables(meta)
        self.num_decode = nd
        self.q_lens = [1] * nd + [p.end - p.start for p in meta.prefills]
        self.kv_lens = dec_lens + [p.num_cached + p.end - p.start for p in meta.prefills]
        self.rows = dec_tables + chunk_tables   # block table of each sequence (host lists)
        row = nd
        for p in meta.prefills:
            if p.start != row:
                raise ValueError(f"flashinfer backend: prefill chunk rows must follow the decode rows in order "
                                 f"(chunk at row {p.start}, expected {row})")
            row = p.end
        # Append (whole page tables: new tokens are written at their absolute positions), on the device.
        indptr, indices, last = self.csr(range(len(self.kv_lens)), 0)
        self.indptr, self.indices, self.last = (t.to(device, non_blocking=True) for t in (indptr, indices, last))
        append_indptr = self.host(_cumsum(self.q_lens)).to(device, non_blocking=True)
        seq_lens = self.host(self.kv_lens).to(device, non_blocking=True)
        self.batch_indices, self.positions = fi.get_batch_indices_positions(append_indptr, seq_lens, row)

    def host(self, values: list[int]) -> torch.Tensor:
        """An int32 host tensor, pinned on cuda so its copy to the device is asynchronous."""
        t = torch.tensor(values, dtype=torch.int32)
        return t.pin_memory() if self.pin else t

    def csr(self, seqs: range, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, last_page_len) of sequences `seqs`; with a window, each sequence's pages start at
        the first one its first query's window reaches (its kv length shortened by the pages left out)."""
        bs = self.page_size
        indptr, indices, last = [0], [], []
        for s in seqs:
            kv_len, q_len = self.kv_lens[s], self.q_lens[s]
            pages = -(-kv_len // bs)
            first = max(0, kv_len - q_len - window + 1) // bs if window else 0
            indices += self.rows[s][first:pages]
            indptr.append(len(indices))
            last.append(kv_len - (pages - 1) * bs)
        return self.host(indptr), self.host(indices), self.host(last)


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _host_tables(meta: AttentionMetadata) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(decode context lengths, decode block-table rows, prefill chunk block tables) as host lists: one copy
    from the device (the step's tables are small; the previous step's sampling already synchronised)."""
    nd = meta.num_decode_tokens
    parts = []
    width = 0
    if nd:
        tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and context_lens is not None, "a step with decode rows"
        parts += [context_lens.reshape(-1), tables.reshape(-1)]
        width = tables.shape[1]
    parts += [p.block_table.reshape(-1) for p in meta.prefills]
    flat = torch.cat([t.to(torch.long) for t in parts]).cpu().tolist() if parts else []
    i = 0
    lens, dec = [], []
    if nd:
        lens, i = flat[:nd], nd
        dec = [flat[i + r * width:i + (r + 1) * width] for r in range(nd)]
        i += nd * width
    chunks = []
    for p in meta.prefills:
        n = p.block_table.numel()
        chunks.append(flat[i:i + n])
        i += n
    return lens, dec, chunks


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import flashinfer  # imported only when this backend is selected

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # the torch path: float32 models, int8 KV pools, and kernels that could not be built
        self.reference = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
        self.fi = flashinfer
        # vLLM's rule: the tensor-core decode kernel pays off for query groups larger than 4.
        self.use_tensor_cores = num_heads // num_kv_heads > 4
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[str, int], object] = {}
        self._warned: set[tuple[torch.dtype, torch.dtype]] = set()
        self._working: set[tuple[str, bool]] = set()   # (decode | prefill, windowed): kernels built and run
        self.disabled: str | None = None  # why FlashInfer's kernels are unavailable (the torch path runs instead)

    def prepare(self, meta: AttentionMetadata) -> FlashInferMetadata:
        """This step's metadata; the runner calls it once per step and hands the result to every layer."""
        return FlashInferMetadata(self, meta)

    def _wrapper(self, kind: str, window: int, device: torch.device):
        """One wrapper per (kind, window) for the engine's life (re-planned every step), all sharing one float
        workspace buffer (their runs never overlap: one stream, layer after layer)."""
        if self._workspace is None or self._workspace.device != device:
            size = CUDA_WORKSPACE_BYTES if device.type == "cuda" else HOST_WORKSPACE_BYTES
            self._workspace = torch.empty(size, dtype=torch.uint8, device=device)
            self._wrappers.clear()
        key = (kind, window)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
            else:
                self._wrappers[key] = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._wrappers[key]

    def plan(self, kind: str, window: int, tables: _PageTables, q_dtype: torch.dtype, k_cache: torch.Tensor):
        nd, n = tables.num_decode, len(tables.kv_lens)
        seqs = range(nd) if kind == "decode" else range(nd, n)
        indptr, indices, last = tables.csr(seqs, window)
        wrapper = self._wrapper(kind, window, k_cache.device)
        common = dict(window_left=window - 1 if window else -1, q_data_type=q_dtype, kv_data_type=k_cache.dtype)
        args = (self.num_heads, self.num_kv_heads, self.head_dim, tables.page_size)
        if kind == "decode":
            wrapper.plan(indptr, indices, last, *args, pos_encoding_mode="NONE", **common)
        else:
            qo_indptr = tables.host(_cumsum(tables.q_lens[nd:]))
            wrapper.plan(qo_indptr, indptr, indices, last, *args, causal=True, **common)
        return wrapper

    def _kernels_take(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        ok = q.dtype in KERNEL_DTYPES and k_cache.dtype in KERNEL_DTYPES
        key = (q.dtype, k_cache.dtype)
        if not ok and key not in self._warned:
            self._warned.add(key)
            log.warning("flashinfer attention: FlashInfer's kernels take float16 / bfloat16 activations and KV, not "
                        "%s with a %s KV pool: running the torch reference path instead (dtype=bfloat16 for "
                        "FlashInfer)", str(q.dtype).removeprefix("torch."), str(k_cache.dtype).removeprefix("torch."))
        return ok

    def _append(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: FlashInferMetadata) -> None:
        """The new K/V rows into their pages (the torch path writes its own with `write_kv`)."""
        t = meta.tables(k_cache.shape[1])
        self.fi.append_paged_kv_cache(k, v, t.batch_indices, t.positions, (k_cache, v_cache), t.indices, t.indptr,
                                      t.last, kv_layout="NHD")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: FlashInferMetadata, window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: one layer's `[num_blocks, block_size, Hkv, D]` (NHD pages);
        window > 0: each token sees its last `window` positions, itself included. Returns [T, Hq, D]."""
        if self.disabled is not None or not self._kernels_take(q, k_cache):
            return self.reference.forward(q, k, v, k_cache, v_cache, meta.torch_meta(), window)
        nd = meta.num_decode_tokens
        # the kernels differ by kind and by whether a window is on (a template parameter of FlashInfer's kernels)
        kinds = {(kind, window > 0) for kind, rows in (("decode", nd), ("prefill", q.shape[0] - nd)) if rows}
        if kinds <= self._working:
            return self._flashinfer(q, k, v, k_cache, v_cache, meta, window)
        # First use of a kernel: FlashInfer builds (JIT-compiles with nvcc) or loads it now. A host where that
        # fails (no CUDA toolkit, no prebuilt kernel for this GPU) runs the torch path, said once and loudly;
        # an argument FlashInfer refuses (ValueError, ...) is a bug here and raises.
        try:
            out = self._flashinfer(q, k, v, k_cache, v_cache, meta, window)
        except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError):
            raise
        except Exception as exc:
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.error("flashinfer attention: FlashInfer's kernels could not be built or loaded (%s): running the "
                      "torch reference path instead (attention_backend=torch to choose it)", self.disabled)
            return self.reference.forward(q, k, v, k_cache, v_cache, meta.torch_meta(), window)
        self._working |= kinds
        return out

    def _flashinfer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: FlashInferMetadata, window: int) -> torch.Tensor:
        self._append(k, v, k_cache, v_cache, meta)
        kv = (k_cache, v_cache)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return meta.plan("decode", window, q, k_cache).run(q, kv)
        if nd == 0:
            return meta.plan("prefill", window, q, k_cache).run(q, kv)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        meta.plan("decode", window, q, k_cache).run(q[:nd], kv, out=out[:nd])
        meta.plan("prefill", window, q, k_cache).run(q[nd:], kv, out=out[nd:])
        return out
