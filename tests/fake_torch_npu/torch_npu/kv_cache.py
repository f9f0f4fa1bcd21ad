"""Paged KV cache writes: `torch_npu.npu_scatter_pa_kv_cache` and `torch_npu._npu_reshape_and_cache`.

Both write token t's key/value rows into slot `slots[t]` = block_id * block_size + offset_in_block of a per-layer
cache `[num_blocks, block_size, num_kv_heads, head_dim]` (ND format), in place.
"""

from __future__ import annotations

import torch

from torch_npu import _state

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)


def _fail(op: str, msg: str) -> None:
    raise RuntimeError(f"{op}: {msg}")


def _scatter(op: str, key, value, key_cache, value_cache, slots: torch.Tensor, skip_negative: bool) -> None:
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slots.to(torch.int64)
    if skip_negative:
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        _fail(op, f"slot mapping values must lie in [0, num_blocks * block_size - 1] = [0, {num_slots - 1}]; got "
                  f"[{int(slots.min())}, {int(slots.max())}]")
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value


def _check_nd(op: str, key, value, key_cache, value_cache, slots, slots_name: str) -> None:
    if key.dim() != 3 or value.dim() != 3:
        _fail(op, f"key and value must be 3-D [num_tokens, num_heads, head_size]; got {tuple(key.shape)} and "
                  f"{tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        _fail(op, "key_cache and value_cache must be 4-D [num_blocks, block_size, num_heads, head_size]")
    if key.shape[:2] != value.shape[:2]:
        _fail(op, f"key and value must have the same first two dims; got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        _fail(op, "key_cache and value_cache must have the same num_blocks, block_size and num_heads")
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        _fail(op, f"cache rows {tuple(key_cache.shape[2:])}/{tuple(value_cache.shape[2:])} do not match key/value "
                  f"rows {tuple(key.shape[1:])}/{tuple(value.shape[1:])}")
    if slots.dim() != 1 or slots.shape[0] != key.shape[0]:
        _fail(op, f"{slots_name} must be 1-D [num_tokens] = [{key.shape[0]}]; got {tuple(slots.shape)}")


def npu_scatter_pa_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                            compress_lens: torch.Tensor | None = None, compress_seq_offsets: torch.Tensor | None = None,
                            seq_lens: torch.Tensor | None = None) -> None:
    """Follows Ascend/op-plugin docs/context/torch_npu-npu_scatter_pa_kv_cache.md (torch_npu 自定义API参考).

    Emulated: scenario 2 (ND caches `[num_blocks, block_size, num_head, head_size]`, k_head_size and v_head_size
    may differ). Restrictions raised: non-contiguous inputs ("输入参数不支持非连续"), key/value/key_cache/
    value_cache dtypes not identical, slot_mapping not int32/int64, key and value first two dims differ, slot
    values outside [0, num_blocks * block_size - 1] (the doc gives the range; the device does not check it).
    Duplicate slots: the doc does not guarantee a result; here the last write wins. Not emulated: scenario 1 (NZ
    caches) and scenario 3 (4-D key with compress_lens / seq_lens).
    """
    op = "npu_scatter_pa_kv_cache"
    _state.record(op)
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None or key.dim() == 4:
        raise NotImplementedError(f"{op}: scenario 3 (compress_lens / seq_lens) is not emulated")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            _fail(op, f"{name}: non-contiguous tensors are not supported (输入参数不支持非连续)")
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        _fail(op, f"key, value, key_cache and value_cache must have one dtype; got {key.dtype}, {value.dtype}, "
                  f"{key_cache.dtype}, {value_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(op, f"slot_mapping: dtype must be int32 or int64; got {slot_mapping.dtype}")
    if key_cache.dim() == 4 and key.dim() == 3 and key_cache.shape[2] != key.shape[1]:
        raise NotImplementedError(f"{op}: scenario 1 (NZ caches [num_blocks, H // last_dim, block_size, "
                                  "last_dim]) is not emulated")
    _check_nd(op, key, value, key_cache, value_cache, slot_mapping, "slot_mapping")
    _scatter(op, key, value, key_cache, value_cache, slot_mapping, skip_negative=False)


def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """The ATB ReshapeAndCacheOperation behind torch_npu's private `_npu_reshape_and_cache`, called as
    vllm-ascend does (vllm_ascend/attention/attention_v1.py: key=, value=, key_cache=, value_cache=,
    slot_indices=). Follows the CANN "ReshapeAndCacheOperation" page (ascendtbapi, e.g.
    https://www.hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/ascendtbapi/ascendtb_01_0073.html):
    key/value `[num_tokens, num_head, head_size]`, caches `[num_blocks, block_size, num_head, head_size]` (ND),
    slotMapping `[num_tokens]` int32 (block_id * block_size + offset_in_block), key/value/caches of one dtype
    among float16/bfloat16/int8, caches written in place. A negative slot moves nothing (82RC1 page:
    "取值为负数时不进行任何搬运操作"), which is how padded tokens are skipped. NZ caches are not emulated.
    """
    op = "_npu_reshape_and_cache"
    _state.record(op)
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        _fail(op, f"key, value, keyCache and valueCache must have exactly the same dtype; got {key.dtype}, "
                  f"{value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if key.dtype not in _CACHE_DTYPES:
        _fail(op, f"dtype must be float16, bfloat16 or int8; got {key.dtype}")
    if slot_indices.dtype != torch.int32:
        _fail(op, f"slotMapping: dtype must be int32; got {slot_indices.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not t.is_contiguous():   # written in place through a flat view
            _fail(op, f"{name}: the cache must be one contiguous tensor")
    _check_nd(op, key, value, key_cache, value_cache, slot_indices, "slotMapping")
    _scatter(op, key, value, key_cache, value_cache, slot_indices, skip_negative=True)
