"""The torch_npu CPU emulator (tests/fake_torch_npu): each operator against a plain reference written here, and
each documented restriction raised."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from npu_emulator import emulated_torch_npu, npu_emulator_fixture, subprocess_env  # noqa: F401  (the fixture)

FIA = "npu_fused_infer_attention_score"


# ---------------------------------------------------------------------------------------------- references


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible) -> torch.Tensor:
    """q [q, N, D], k/v [kv, KV_N, D]; visible(i, j) -> bool. Row by row, head by head, explicit softmax."""
    q, k, v = q.double(), k.double(), v.double()
    n, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(n):
        for i in range(q.shape[0]):
            cols = [j for j in range(k.shape[0]) if visible(i, j)]
            if not cols:
                continue
            s = torch.stack([q[i, h] @ k[j, h // group] for j in cols]) * scale
            p = torch.exp(s - s.max())
            p = p / p.sum()
            out[i, h] = sum(p[c] * v[j, h // group] for c, j in enumerate(cols))
    return out


def gather_tokens(cache: torch.Tensor, table_row: list[int], n: int, block_size: int) -> torch.Tensor:
    """Token t of a request lives at slot table_row[t // block_size] * block_size + t % block_size of the
    [blocks, block_size, KV_N, D] cache."""
    return torch.stack([cache[table_row[t // block_size], t % block_size] for t in range(n)])


def causal(q_len: int, kv_len: int):
    return lambda i, j: j <= i + kv_len - q_len


def window(q_len: int, kv_len: int, w: int):
    return lambda i, j: 0 <= (i + kv_len - q_len) - j < w


def compressed_mask() -> torch.Tensor:
    return torch.ones(2048, 2048, dtype=torch.int8).triu(1)


def make_paged(num_blocks: int, block_size: int, kv_heads: int, d: int, dtype=torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    return k, v


def close(out: torch.Tensor, ref: torch.Tensor, atol: float = 2e-3) -> None:
    torch.testing.assert_close(out.double(), ref.to(out.dtype).double(), atol=atol, rtol=1e-2)


# ---------------------------------------------------------------------------------------------- device API


def test_install_and_remove(npu_emulator):
    assert torch.npu is npu_emulator.npu and npu_emulator.EMULATED
    from pdcluster.engine import device

    assert device.npu_available()


def test_uninstalled_after_context():
    with emulated_torch_npu():
        import torch_npu  # noqa: F401
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
    with pytest.raises(ImportError):
        import torch_npu  # noqa: F401,F811
    from pdcluster.engine import device

    assert not device.npu_available()


def test_child_processes_import_the_emulator():
    out = subprocess.run([sys.executable, "-c", "import torch, torch_npu; print(torch_npu.EMULATED, "
                          "torch.npu.device_count())"], env=subprocess_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["True", "1"]


def test_device_api():
    with emulated_torch_npu(device_count=4, free_memory=3 << 30, total_memory=8 << 30) as torch_npu:
        assert torch.npu.is_available() and torch.npu.device_count() == 4
        torch.npu.set_device(2)
        assert torch.npu.current_device() == 2
        torch.npu.set_device("npu:3")
        assert torch.npu.current_device() == 3
        assert torch.npu.mem_get_info(1) == (3 << 30, 8 << 30)
        with torch.npu.device(1):
            assert torch.npu.current_device() == 1
        assert torch.npu.current_device() == 3
        with pytest.raises(RuntimeError, match="Invalid device ID 4"):
            torch.npu.set_device(4)
        torch.npu.synchronize()
        start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        start.record()
        end.record()
        assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
        with pytest.raises(RuntimeError, match="enable_timing"):
            torch.npu.Event().elapsed_time(end)
        assert torch_npu.npu.current_stream().query()


def test_thread_without_device_context_fails(npu_emulator):
    """Ascend binds a device context to a thread: an op in a thread that never called set_device fails."""
    x = torch.randn(4, 8)
    errors: list[BaseException] = []

    def unbound():
        try:
            npu_emulator.npu_swiglu(x)
        except RuntimeError as e:
            errors.append(e)

    def bound():
        torch.npu.set_device(0)
        npu_emulator.npu_swiglu(x)

    for target in (unbound, bound):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert len(errors) == 1 and "The context is empty" in str(errors[0])
    assert npu_emulator._emulator.calls["npu_swiglu"] == 1


def test_lazy_init_binds_only_the_initialising_thread():
    with emulated_torch_npu(bind=False) as torch_npu:
        with pytest.raises(RuntimeError, match="context is empty"):
            torch_npu.npu_swiglu(torch.randn(2, 4))
        torch.npu.init()
        torch_npu.npu_swiglu(torch.randn(2, 4))


# ---------------------------------------------------------------------------------------------- FIA: paged decode


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fia_paged_decode_bsh_gqa(npu_emulator, dtype):
    n, kv_heads, d, bs = 4, 2, 16, 16
    k_cache, v_cache = make_paged(12, bs, kv_heads, d, dtype)
    table = [[3, 7, 1, 0], [5, 0, 0, 0], [2, 9, 10, 11]]
    kv_lens = [40, 9, 64]
    q = torch.randn(3, 1, n * d).to(dtype)
    out, lse = npu_emulator.npu_fused_infer_attention_score(
        q, k_cache.view(12, bs, -1), v_cache.view(12, bs, -1), num_heads=n, num_key_value_heads=kv_heads,
        input_layout="BSH", scale=0.25, block_table=torch.tensor(table, dtype=torch.int32), block_size=bs,
        actual_seq_lengths_kv=kv_lens)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1,) and lse.item() == 0
    for b in range(3):
        k = gather_tokens(k_cache, table[b], kv_lens[b], bs)
        v = gather_tokens(v_cache, table[b], kv_lens[b], bs)
        ref = ref_attention(q[b].view(1, n, d), k, v, 0.25, lambda i, j: True)
        close(out[b].view(1, n, d), ref, atol=2e-3 if dtype == torch.float16 else 2e-2)


def test_fia_paged_decode_bnsd_with_head_major_cache(npu_emulator):
    """BNSD queries may use a (blocknum, KV_N, blocksize, D) cache."""
    n, kv_heads, d, bs = 8, 1, 32, 32
    k_cache, v_cache = make_paged(6, bs, kv_heads, d)
    table, kv_lens = [[4, 2], [0, 5]], [33, 64]
    q = torch.randn(2, n, 1, d).half()
    out, _ = npu_emulator.npu_fused_infer_attention_score(
        q, k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous(), num_heads=n,
        num_key_value_heads=kv_heads, input_layout="BNSD", scale=1 / math.sqrt(d), block_size=bs,
        block_table=torch.tensor(table, dtype=torch.int32), actual_seq_lengths_kv=kv_lens)
    for b in range(2):
        k = gather_tokens(k_cache, table[b], kv_lens[b], bs)
        v = gather_tokens(v_cache, table[b], kv_lens[b], bs)
        close(out[b].transpose(0, 1), ref_attention(q[b].transpose(0, 1), k, v, 1 / math.sqrt(d), lambda i, j: True))


def test_fia_decode_ignores_sparse_arguments_but_honours_a_mask(npu_emulator):
    """Q_S = 1: sparse_mode / pre_tokens / next_tokens are invalid (ignored); a (B, KV_S) mask hides keys."""
    n, d, bs = 2, 16, 16
    k_cache, v_cache = make_paged(4, bs, n, d)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(2, 1, n * d).half()
    args = dict(num_heads=n, input_layout="BSH", block_size=bs, block_table=table, actual_seq_lengths_kv=[30, 32])
    kc, vc = k_cache.view(4, bs, -1), v_cache.view(4, bs, -1)
    full, _ = npu_emulator.npu_fused_infer_attention_score(q, kc, vc, **args)
    banded, _ = npu_emulator.npu_fused_infer_attention_score(q, kc, vc, sparse_mode=4, pre_tokens=3, next_tokens=0,
                                                             **args)
    assert torch.equal(full, banded)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[:, :20] = True                                  # e.g. positions outside a sliding window
    masked, _ = npu_emulator.npu_fused_infer_attention_score(q, kc, vc, atten_mask=mask, **args)
    k = gather_tokens(k_cache, [0, 1], 30, bs)
    v = gather_tokens(v_cache, [0, 1], 30, bs)
    close(masked[0].view(1, n, d), ref_attention(q[0].view(1, n, d), k, v, 1.0, lambda i, j: j >= 20))


# ---------------------------------------------------------------------------------------------- FIA: prefill


def test_fia_tnd_paged_causal_mixed_batch(npu_emulator):
    """vllm-ascend's call: TND, block_table, sparse_mode=3 with the 2048 mask, cumulative query ends and
    per-request KV lengths; a decode row, a chunk after cached context, a fresh prompt."""
    n, kv_heads, d, bs = 4, 2, 16, 128
    k_cache, v_cache = make_paged(8, bs, kv_heads, d)
    table = [[6, 0, 0], [1, 4, 0], [2, 3, 5]]
    q_lens, kv_lens = [1, 7, 200], [100, 140, 200]
    cum = [sum(q_lens[:i + 1]) for i in range(3)]
    q = torch.randn(cum[-1], n, d).half()
    out, lse = npu_emulator.npu_fused_infer_attention_score(
        q, k_cache.view(8, bs, -1), v_cache.view(8, bs, -1), num_heads=n, num_key_value_heads=kv_heads,
        input_layout="TND", scale=0.125, block_table=torch.tensor(table, dtype=torch.int32), block_size=bs,
        actual_seq_lengths=cum, actual_seq_lengths_kv=kv_lens, sparse_mode=3, atten_mask=compressed_mask(),
        softmax_lse_flag=True)
    assert out.shape == q.shape and lse.shape == (cum[-1], n, 1) and lse.dtype == torch.float32
    start = 0
    for b in range(3):
        rows = q[start:start + q_lens[b]]
        k = gather_tokens(k_cache, table[b], kv_lens[b], bs)
        v = gather_tokens(v_cache, table[b], kv_lens[b], bs)
        if b < 2:   # the reference is row by row: check the short ones in full, the long one on a few rows
            close(out[start:cum[b]], ref_attention(rows, k, v, 0.125, causal(q_lens[b], kv_lens[b])))
        else:
            picks = [0, 63, 199]
            ref = ref_attention(rows[picks], k, v, 0.125, lambda i, j, picks=picks: j <= picks[i])
            close(out[start:cum[b]][picks], ref)
        start = cum[b]
    # lse of the decode row: logsumexp of its scaled scores over all 100 keys
    k = gather_tokens(k_cache, table[0], 100, bs).float().repeat_interleave(2, dim=1)
    scores = torch.einsum("nd,knd->nk", q[0].float(), k) * 0.125
    torch.testing.assert_close(lse[0, :, 0], torch.logsumexp(scores, dim=-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH"])
def test_fia_dense_sliding_window_band(npu_emulator, layout):
    """sparse_mode=4 (band, origin bottom right), pre_tokens = window - 1, next_tokens = 0: each query sees its
    last `window` positions including itself, as the engine's sliding window does."""
    n, kv_heads, d, w = 4, 1, 16, 5
    q_lens, kv_len = [6, 3], 12
    q = torch.randn(2, 6, n, d).half()
    k = torch.randn(2, kv_len, kv_heads, d).half()
    v = torch.randn(2, kv_len, kv_heads, d).half()

    def to_layout(t):
        if layout == "BNSD":
            return t.transpose(1, 2).contiguous()
        return t.reshape(t.shape[0], t.shape[1], -1) if layout == "BSH" else t

    out, _ = npu_emulator.npu_fused_infer_attention_score(
        to_layout(q), to_layout(k), to_layout(v), num_heads=n, num_key_value_heads=kv_heads, input_layout=layout,
        scale=0.3, actual_seq_lengths=q_lens, actual_seq_lengths_kv=[kv_len, 9], sparse_mode=4, pre_tokens=w - 1,
        next_tokens=0, atten_mask=compressed_mask())
    out = out.transpose(1, 2) if layout == "BNSD" else out.reshape(2, 6, n, d)
    for b, kvl in enumerate([kv_len, 9]):
        ref = ref_attention(q[b, :q_lens[b]], k[b, :kvl], v[b, :kvl], 0.3, window(q_lens[b], kvl, w))
        close(out[b, :q_lens[b]], ref)
        assert not out[b, q_lens[b]:].any()   # rows past actual_seq_lengths are left zero


def test_fia_sparse_modes_differ_by_origin(npu_emulator):
    """mode 2 (leftUpCausal) aligns the diagonal at the top left, mode 3 (rightDownCausal) at the bottom right,
    mode 0 with a full mask and pre/next tokens counts from the top left."""
    n, d, q_len, kv_len = 2, 16, 4, 10
    q = torch.randn(1, q_len, n, d).half()
    k = torch.randn(1, kv_len, n, d).half()
    v = torch.randn(1, kv_len, n, d).half()
    args = dict(num_heads=n, input_layout="BSND", scale=0.25)
    left, _ = npu_emulator.npu_fused_infer_attention_score(q, k, v, sparse_mode=2, atten_mask=compressed_mask(),
                                                           **args)
    right, _ = npu_emulator.npu_fused_infer_attention_score(q, k, v, sparse_mode=3, atten_mask=compressed_mask(),
                                                            **args)
    full_mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    full_mask[:, 8:] = True
    banded, _ = npu_emulator.npu_fused_infer_attention_score(q, k, v, sparse_mode=0, atten_mask=full_mask,
                                                             pre_tokens=1, next_tokens=5, **args)
    close(left[0], ref_attention(q[0], k[0], v[0], 0.25, lambda i, j: j <= i))
    close(right[0], ref_attention(q[0], k[0], v[0], 0.25, causal(q_len, kv_len)))
    close(banded[0], ref_attention(q[0], k[0], v[0], 0.25, lambda i, j: j < 8 and i - 1 <= j <= i + 5))
    no_mask, _ = npu_emulator.npu_fused_infer_attention_score(q, k, v, pre_tokens=0, next_tokens=0, **args)
    close(no_mask[0], ref_attention(q[0], k[0], v[0], 0.25, lambda i, j: True))   # no mask: pre/next ignored


def test_fia_empty_kv_gives_zeros(npu_emulator):
    q = torch.randn(1, 2, 2, 16).half()
    k = torch.randn(1, 4, 2, 16).half()
    out, lse = npu_emulator.npu_fused_infer_attention_score(q, k, k.clone(), num_heads=2, input_layout="BSND",
                                                            actual_seq_lengths_kv=[0], softmax_lse_flag=True)
    assert not out.any() and torch.isinf(lse).all()


# ---------------------------------------------------------------------------------------------- FIA: int8 KV


def quantize(x: torch.Tensor, dim) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-6) / 127
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def test_fia_int8_paged_decode_per_channel(npu_emulator):
    n, kv_heads, d, bs = 4, 2, 32, 32
    k_cache, v_cache = make_paged(4, bs, kv_heads, d)
    kq, k_scale = quantize(k_cache, dim=(0, 1))          # one scale per (head, channel)
    vq, v_scale = quantize(v_cache, dim=(0, 1))
    scale = torch.stack([k_scale.reshape(-1), v_scale.reshape(-1)]).half()       # (2, H), BSH per-channel
    offset = torch.zeros_like(scale)
    table, kv_lens = [[1, 3], [2, 0]], [50, 64]
    q = torch.randn(2, 1, n * d).half()
    out, _ = npu_emulator.npu_fused_infer_attention_score(
        q, kq.view(4, bs, -1), vq.view(4, bs, -1), num_heads=n, num_key_value_heads=kv_heads, input_layout="BSH",
        scale=0.2, block_table=torch.tensor(table, dtype=torch.int32), block_size=bs, actual_seq_lengths_kv=kv_lens,
        antiquant_scale=scale, antiquant_offset=offset)
    ks, vs = scale[0].float().view(kv_heads, d), scale[1].float().view(kv_heads, d)
    for b in range(2):
        k = gather_tokens(kq, table[b], kv_lens[b], bs).float() * ks
        v = gather_tokens(vq, table[b], kv_lens[b], bs).float() * vs
        close(out[b].view(1, n, d), ref_attention(q[b].view(1, n, d), k, v, 0.2, lambda i, j: True))


def test_fia_int8_paged_decode_per_token_per_head(npu_emulator):
    """key/value_antiquant_mode 5: one float32 scale per (block, head, slot), the engine's int8 KV granularity."""
    n, kv_heads, d, bs = 4, 2, 32, 32
    k_cache, v_cache = make_paged(3, bs, kv_heads, d)
    kq, ks = quantize(k_cache, dim=-1)                  # [blocks, bs, KV_N, 1]
    vq, vs = quantize(v_cache, dim=-1)
    k_scale = ks.squeeze(-1).transpose(1, 2).contiguous()   # (blocknum, N, blocksize)
    v_scale = vs.squeeze(-1).transpose(1, 2).contiguous()
    table, kv_lens = [[2, 0]], [45]
    q = torch.randn(1, 1, n * d).half()
    out, _ = npu_emulator.npu_fused_infer_attention_score(
        q, kq.view(3, bs, -1), vq.view(3, bs, -1), num_heads=n, num_key_value_heads=kv_heads, input_layout="BSH",
        block_table=torch.tensor(table, dtype=torch.int32), block_size=bs, actual_seq_lengths_kv=kv_lens,
        key_antiquant_scale=k_scale, value_antiquant_scale=v_scale, key_antiquant_mode=5, value_antiquant_mode=5)
    k = gather_tokens(kq.float() * ks, table[0], 45, bs)
    v = gather_tokens(vq.float() * vs, table[0], 45, bs)
    close(out[0].view(1, n, d), ref_attention(q[0].view(1, n, d), k, v, 1.0, lambda i, j: True))


# ---------------------------------------------------------------------------------------------- FIA: restrictions


def _paged_decode_args(dtype=torch.float16, bs=16, blocks=4):
    q = torch.randn(2, 1, 2 * 16).to(dtype)
    k = torch.randn(blocks, bs, 32).to(dtype if dtype != torch.float32 else torch.float32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return (q, k, k.clone()), dict(num_heads=2, input_layout="BSH", block_size=bs, block_table=table,
                                    actual_seq_lengths_kv=[bs, bs])


def _prefill_args(bs=128):
    q = torch.randn(10, 2, 16).half()
    k = torch.randn(4, bs, 32).half()
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    return (q, k, k.clone()), dict(num_heads=2, input_layout="TND", block_size=bs, block_table=table,
                                    actual_seq_lengths=[10], actual_seq_lengths_kv=[10], sparse_mode=3,
                                    atten_mask=compressed_mask())


def _with(args, **changes):
    return {**args, **changes}


@pytest.mark.parametrize("case, match", [
    ("fp32", "query: dtype torch.float32 is not supported"),
    ("noncontiguous", "query: non-contiguous"),
    ("table_int64", "block_table: dtype must be int32"),
    ("decode_block_8", "block_size must be 16-aligned"),
    ("no_kv_lens", "page attention needs actual_seq_lengths_kv"),
    ("table_rows", "first dim equal to B"),
    ("table_narrow", "maxBlockNumPerSeq"),
    ("heads_indivisible", "must be divisible by num_key_value_heads"),
    ("group_over_64", "must not exceed 64"),
    ("kv_shape", "exactly the same shape and dtype"),
    ("kv_lens_length", "is not supported with batch 2"),
    ("head_major_bsh", "supported only for BNSD / TND"),
    ("bad_block_id", "outside"),
])
def test_fia_decode_restrictions(npu_emulator, case, match):
    (q, k, v), args = _paged_decode_args()
    if case == "fp32":
        (q, k, v), args = _paged_decode_args(torch.float32)
    elif case == "noncontiguous":
        q = torch.randn(2, 1, 4 * 16).half()[..., ::2]
    elif case == "table_int64":
        args = _with(args, block_table=args["block_table"].long())
    elif case == "decode_block_8":
        (q, k, v), args = _paged_decode_args(bs=8, blocks=8)
    elif case == "no_kv_lens":
        args = _with(args, actual_seq_lengths_kv=None)
    elif case == "table_rows":
        args = _with(args, block_table=args["block_table"][:1])
    elif case == "table_narrow":
        args = _with(args, actual_seq_lengths_kv=[40, 16])
    elif case == "heads_indivisible":
        q, args = torch.randn(2, 1, 3 * 16).half(), _with(args, num_heads=3, num_key_value_heads=2)
    elif case == "group_over_64":
        q = torch.randn(2, 1, 65 * 2).half()
        k = torch.randn(4, 16, 2).half()
        v, args = k.clone(), _with(args, num_heads=65, num_key_value_heads=1)
    elif case == "kv_shape":
        v = torch.randn(5, 16, 32).half()
    elif case == "kv_lens_length":
        args = _with(args, actual_seq_lengths_kv=torch.tensor([], dtype=torch.int64))
    elif case == "head_major_bsh":
        k = torch.randn(4, 1, 16, 32).half()
        v = k.clone()
    elif case == "bad_block_id":
        args = _with(args, block_table=torch.tensor([[0, 1], [9, 3]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=match):
        getattr(npu_emulator, FIA)(q, k, v, **args)


@pytest.mark.parametrize("case, match", [
    ("block_64", "multiple of 128 between 128 and 512"),
    ("block_640", "multiple of 128 between 128 and 512"),
    ("int8_prefill", "supports float16 / bfloat16 key and value only"),
    ("sparse_5", "is not supported yet"),
    ("sparse_9", "only supports 0, 1, 2, 3, 4"),
    ("no_mask", "needs the optimized atten_mask"),
    ("mask_shape", "needs the optimized atten_mask"),
    ("mask_not_triangular", "compressed lower-triangular"),
    ("tnd_no_lens", "TND needs actual_seq_lengths"),
    ("tnd_mode0_mask", "TND supports sparse_mode = 0 without atten_mask"),
    ("tnd_not_cumulative", "non-decreasing"),
    ("mask_dtype", "atten_mask: dtype torch.float16"),
])
def test_fia_prefill_restrictions(npu_emulator, case, match):
    (q, k, v), args = _prefill_args()
    if case == "block_64":
        (q, k, v), args = _prefill_args(bs=64)
    elif case == "block_640":
        (q, k, v), args = _prefill_args(bs=640)
    elif case == "int8_prefill":
        k = torch.zeros(4, 128, 32, dtype=torch.int8)
        v, args = k.clone(), _with(args, antiquant_scale=torch.ones(2).half())
    elif case == "sparse_5":
        args = _with(args, sparse_mode=5)
    elif case == "sparse_9":
        args = _with(args, sparse_mode=9)
    elif case == "no_mask":
        args = _with(args, atten_mask=None, sparse_mode=2, input_layout="BSND")
        q = q.view(1, 10, 2, 16)
    elif case == "mask_shape":
        args = _with(args, atten_mask=compressed_mask()[:1024, :1024].contiguous())
    elif case == "mask_not_triangular":
        args = _with(args, atten_mask=torch.zeros(2048, 2048, dtype=torch.int8))
    elif case == "tnd_no_lens":
        args = _with(args, actual_seq_lengths=None)
    elif case == "tnd_mode0_mask":
        args = _with(args, sparse_mode=0)
    elif case == "tnd_not_cumulative":
        q = torch.randn(10, 2, 16).half()
        args = _with(args, block_table=torch.tensor([[0], [1]], dtype=torch.int32), actual_seq_lengths=[6, 4],
                     actual_seq_lengths_kv=[6, 4])
    elif case == "mask_dtype":
        args = _with(args, atten_mask=compressed_mask().half())
    with pytest.raises(RuntimeError, match=match):
        getattr(npu_emulator, FIA)(q, k, v, **args)


def test_fia_documented_but_not_emulated_features(npu_emulator):
    (q, k, v), args = _paged_decode_args()
    with pytest.raises(NotImplementedError, match="pse_shift"):
        npu_emulator.npu_fused_infer_attention_score(q, k, v, pse_shift=torch.zeros(1), **args)
    with pytest.raises(NotImplementedError, match="BNSD_BSND"):
        npu_emulator.npu_fused_infer_attention_score(q, k, v, **_with(args, input_layout="BNSD_BSND"))


# ---------------------------------------------------------------------------------------------- KV cache writes


@pytest.mark.parametrize("op", ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"])
def test_kv_cache_write(npu_emulator, op):
    blocks, bs, heads, d = 4, 16, 2, 8
    k_cache = torch.zeros(blocks, bs, heads, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, heads, d).bfloat16()
    value = torch.randn(5, heads, d).bfloat16()
    slots = torch.tensor([0, 17, 63, 33, 15], dtype=torch.int32)
    getattr(npu_emulator, op)(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // bs, s % bs], key[t]) and torch.equal(v_cache[s // bs, s % bs], value[t])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 5   # nothing else written


def test_reshape_and_cache_skips_negative_slots(npu_emulator):
    k_cache = torch.zeros(2, 16, 1, 8, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 8, dtype=torch.int8)
    npu_emulator._npu_reshape_and_cache(key, key * 2, k_cache, v_cache, torch.tensor([3, -1, 20], dtype=torch.int32))
    assert int(k_cache.sum()) == 16 and int(v_cache.sum()) == 32


@pytest.mark.parametrize("case, match", [
    ("noncontiguous", "non-contiguous"),
    ("dtype_mix", "must have one dtype"),
    ("slot_dtype", "slot_mapping: dtype must be int32 or int64"),
    ("slot_range", r"slot mapping values must lie in \[0, num_blocks \* block_size - 1\]"),
    ("kv_rows", "same first two dims"),
])
def test_scatter_pa_kv_cache_restrictions(npu_emulator, case, match):
    k_cache = torch.zeros(2, 16, 2, 8).half()
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 8).half(), torch.randn(3, 2, 8).half()
    slots = torch.tensor([0, 1, 2], dtype=torch.int64)
    if case == "noncontiguous":
        key = torch.randn(3, 8, 2).half().transpose(1, 2)
    elif case == "dtype_mix":
        value = value.bfloat16()
    elif case == "slot_dtype":
        slots = slots.to(torch.int16)
    elif case == "slot_range":
        slots = torch.tensor([0, 1, 32])
    elif case == "kv_rows":
        value = torch.randn(4, 2, 8).half()
    with pytest.raises(RuntimeError, match=match):
        npu_emulator.npu_scatter_pa_kv_cache(key, value, k_cache, v_cache, slots)


@pytest.mark.parametrize("case, match", [
    ("slot_int64", "slotMapping: dtype must be int32"),
    ("float32", "dtype must be float16, bfloat16 or int8"),
    ("dtype_mix", "exactly the same dtype"),
    ("slot_count", r"slotMapping must be 1-D \[num_tokens\]"),
])
def test_reshape_and_cache_restrictions(npu_emulator, case, match):
    dtype = torch.float32 if case == "float32" else torch.float16
    k_cache = torch.zeros(2, 16, 2, 8, dtype=dtype)
    key = torch.randn(3, 2, 8).to(dtype)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    if case == "slot_int64":
        slots = slots.long()
    elif case == "dtype_mix":
        key = key.bfloat16()
    elif case == "slot_count":
        slots = slots[:2]
    with pytest.raises(RuntimeError, match=match):
        npu_emulator._npu_reshape_and_cache(key, key.clone(), k_cache, k_cache.clone(), slots)


# ---------------------------------------------------------------------------------------------- norms, rope, swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm(npu_emulator, dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    gamma = torch.randn(64).to(dtype)
    y, rstd = npu_emulator.npu_rms_norm(x, gamma, epsilon=1e-5)
    ref_rstd = 1 / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1) and y.dtype == dtype
    torch.testing.assert_close(rstd.double(), ref_rstd, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, (x.double() * ref_rstd * gamma.double()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_rms_norm_rounds_like_the_hf_residual_norm(npu_emulator, dtype):
    """Atlas A2/A3 rounding: x = x1 + x2 in the input dtype, x * rstd rounded before the gamma product -- the
    transformers RMSNorm form `weight * (x * rstd).to(dtype)`, bit for bit."""
    x1, x2 = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    gamma = torch.randn(96).to(dtype)
    y, rstd, x = npu_emulator.npu_add_rms_norm(x1, x2, gamma, 1e-6)
    h = x1 + x2
    h32 = h.float()
    ref = gamma * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(x, h) and torch.equal(y, ref) and rstd.shape == (7, 1) and rstd.dtype == torch.float32


@pytest.mark.parametrize("case, match", [
    ("int", "dtype must be float16, bfloat16 or float32"),
    ("gamma_dtype", "gamma: dtype must be the same"),
    ("one_dim", "2-8 dims are supported"),
    ("gamma_shape", "must be the last dims"),
])
def test_rms_norm_restrictions(npu_emulator, case, match):
    x, gamma = torch.randn(4, 8), torch.randn(8)
    if case == "int":
        x, gamma = x.to(torch.int32), gamma.to(torch.int32)
    elif case == "gamma_dtype":
        gamma = gamma.half()
    elif case == "one_dim":
        x = x[0]
    elif case == "gamma_shape":
        gamma = torch.randn(4)
    with pytest.raises(RuntimeError, match=match):
        npu_emulator.npu_rms_norm(x, gamma)


def test_add_rms_norm_restrictions(npu_emulator):
    x, gamma = torch.randn(4, 8).half(), torch.randn(8).half()
    with pytest.raises(RuntimeError, match="x2 must have x1's shape and dtype"):
        npu_emulator.npu_add_rms_norm(x, x.float(), gamma)
    with pytest.raises(RuntimeError, match="gamma: dtype must be the same"):
        npu_emulator.npu_add_rms_norm(x, x, gamma.bfloat16())


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul(npu_emulator, mode):
    x = torch.randn(2, 5, 3, 16).bfloat16()   # BSND
    angle = torch.randn(1, 5, 1, 8)
    if mode == "half":
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    else:
        cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
    out = npu_emulator.npu_rotary_mul(x, cos.bfloat16(), sin.bfloat16(), rotary_mode=mode)
    xd, c, s = x.double(), cos.bfloat16().double(), sin.bfloat16().double()
    if mode == "half":
        rot = torch.cat((-xd[..., 8:], xd[..., :8]), -1)
    else:
        rot = torch.empty_like(xd)
        rot[..., 0::2], rot[..., 1::2] = -xd[..., 1::2], xd[..., 0::2]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (xd * c + rot * s).bfloat16())


@pytest.mark.parametrize("case, match", [
    ("three_dims", "a 4-D tensor is required"),
    ("odd_d", "D must be a multiple of 2 and < 896"),
    ("mode", "rotary_mode must be 'half' or 'interleave'"),
    ("broadcast", "does not broadcast"),
    ("interleave_layout", "interleave mode supports r layouts"),
])
def test_rotary_mul_restrictions(npu_emulator, case, match):
    x, r = torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8)
    mode = "half"
    if case == "three_dims":
        x = x[0]
    elif case == "odd_d":
        x, r = torch.randn(2, 3, 4, 7), torch.randn(1, 3, 1, 7)
    elif case == "mode":
        mode = "full"
    elif case == "broadcast":
        r = torch.randn(1, 2, 1, 8)
    elif case == "interleave_layout":
        r, mode = torch.randn(2, 3, 1, 8), "interleave"
    with pytest.raises(RuntimeError, match=match):
        npu_emulator.npu_rotary_mul(x, r, r, rotary_mode=mode)


def test_swiglu_first_half_is_the_gate(npu_emulator):
    x = torch.randn(4, 6, 10).half()
    out = npu_emulator.npu_swiglu(x)
    assert out.shape == (4, 6, 5) and out.dtype == torch.float16
    torch.testing.assert_close(out, (F.silu(x[..., :5].double()) * x[..., 5:].double()).half())
    out0 = npu_emulator.npu_swiglu(x, dim=0)
    torch.testing.assert_close(out0, (F.silu(x[:2].double()) * x[2:].double()).half())


@pytest.mark.parametrize("case, match", [
    ("odd", "must be divisible by 2"),
    ("noncontiguous", "non-contiguous"),
    ("empty", "empty tensors are not supported"),
    ("int", "dtype must be float32, float16 or bfloat16"),
    ("dim_range", r"dim must lie in \[-2, 1\]"),
])
def test_swiglu_restrictions(npu_emulator, case, match):
    x, dim = torch.randn(4, 6), -1
    if case == "odd":
        x = torch.randn(4, 5)
    elif case == "noncontiguous":
        x = torch.randn(6, 4).t()
    elif case == "empty":
        x = torch.randn(0, 6)
    elif case == "int":
        x = x.to(torch.int64)
    elif case == "dim_range":
        dim = 2
    with pytest.raises(RuntimeError, match=match):
        npu_emulator.npu_swiglu(x, dim=dim)
