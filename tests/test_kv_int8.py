"""INT8 KV cache (`kv_cache_dtype="int8"`): the row format, attention over it (native kernel and torch path)
against fp32 references, pool capacity, KV transfer of int8 blocks, prefix caching, and the layout check that
refuses a peer with another KV dtype."""

from __future__ import annotations

import asyncio

import pytest
import torch
from paged_decode_cases import decode_meta, dense_attention, needs_compiler, paged_case

from pdcluster import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.attention import native
from pdcluster.engine.attention.cpu_backend import CpuAttentionBackend
from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import KVCachePool, dequantize_rows, quantize_rows
from pdcluster.engine.testing import make_tiny_model, prefill_logits
from pdcluster.kv_transfer import KVLayout, KVReceiver, KVSender, LayoutMismatchError, SharedKVPool, TransferError
from pdcluster.kv_transfer.layout import blocks_of


def test_rows_hold_values_and_their_fp16_scale_within_half_a_step():
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0   # an all-zero row stays zero (no division by a zero scale)
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 66)
    scale = rows[..., 64:].contiguous().view(torch.float16).float()
    back = dequantize_rows(rows, torch.float32)
    assert not back[0, 0].any() and torch.isfinite(back).all()
    assert ((back - x).abs() <= scale * 0.5 + 1e-6).all()
    assert (rows[..., :64].abs().amax(-1) >= 126).flatten()[1:].all()   # the range is used


def _int8_case(dtype, batch, hq, hkv, d, bs, seed=0, max_len=200):
    """`paged_case` with the pool quantized: (q, int8 k, int8 v, float k, float v, tables, lens)."""
    q, k, v, tables, lens = paged_case(dtype, batch, hq, hkv, d, bs, seed, max_len)
    return q, quantize_rows(k), quantize_rows(v), k, v, tables, lens


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv, d, max_len", [(8, 2, 64, 200), (4, 4, 128, 200), (6, 3, 48, 200),
                                                 (12, 2, 64, 600)])   # AVX-512 sizes and plain C; 3 chunks
def test_native_int8_decode_matches_dequantized_reference_and_stays_close_to_float(dtype, hq, hkv, d, max_len):
    q, k8, v8, k, v, tables, lens = _int8_case(dtype, 6, hq, hkv, d, 16, max_len=max_len)
    kernel = native.decode_kernel(dtype, torch.int8)
    out = native.paged_decode(kernel, q, k8, v8, tables, lens, d ** -0.5).float()
    exact = dense_attention(q, dequantize_rows(k8, torch.float32), dequantize_rows(v8, torch.float32), tables, lens, 16)
    unquantized = dense_attention(q, k, v, tables, lens, 16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out - exact).abs().max() < tol
    assert (out - unquantized).abs().max() < 0.05 + tol   # the int8 error itself, against fp32 over float K/V


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
def test_backend_decode_over_an_int8_pool_matches_the_fp32_reference(backend):
    q, k8, v8, k, v, tables, lens = _int8_case(torch.bfloat16, 5, 8, 2, 64, 16, seed=3)
    out = backend(8, 2, 64)._decode(q, k8, v8, decode_meta(tables, lens)).float()
    ref = dense_attention(q, dequantize_rows(k8, torch.float32), dequantize_rows(v8, torch.float32), tables, lens, 16)
    assert (out - ref).abs().max() < 2e-2
    assert (out - dense_attention(q, k, v, tables, lens, 16)).abs().max() < 6e-2


def test_torch_forward_writes_int8_rows_and_prefill_reads_them_back():
    """A prefill chunk after cached context and one without it both attend to the dequantized values."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 32, 4
    k_cache = torch.zeros(8, bs, hkv, d + 2, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = torch.randn(10, hq, d), torch.randn(10, hkv, d), torch.randn(10, hkv, d)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)
    pos = torch.arange(10)
    slots = (table[pos // bs] * bs + pos % bs).to(torch.int32)
    be = TorchAttentionBackend(hq, hkv, d)
    whole = be.forward(q, k, v, k_cache, v_cache, be.prepare(AttentionMetadata(
        slots, prefills=[PrefillChunk(0, 10, 0, table)])))
    assert torch.equal(k_cache[table].flatten(0, 1)[:10], quantize_rows(k))
    # the last 3 tokens again, as a chunk after 7 cached ones: same result as in the whole-prompt pass
    tail = be.forward(q[7:], k[7:], v[7:], k_cache, v_cache, be.prepare(AttentionMetadata(
        slots[7:], prefills=[PrefillChunk(0, 3, 7, table)])))
    assert torch.allclose(tail, whole[7:], atol=1e-5)
    kd, vd = dequantize_rows(quantize_rows(k), torch.float32), dequantize_rows(quantize_rows(v), torch.float32)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None], is_causal=True,
        enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(whole, ref, atol=1e-5)


def test_pool_holds_at_least_1_9x_the_tokens_of_bf16_at_equal_bytes(tmp_path):
    smollm2 = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                     "num_key_value_heads": 3})
    for cfg in (smollm2,):
        ratio = KVCachePool.bytes_per_block(cfg, 16, torch.bfloat16) / KVCachePool.bytes_per_block(cfg, 16, torch.int8)
        assert ratio >= 1.9
    # an engine with head_dim 64, the same pool bytes
    model = make_tiny_model(str(tmp_path), "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    from pdcluster.engine.llm_engine import LLMEngine

    blocks = {kvd: LLMEngine(EngineArgs(model=model, dtype="bfloat16", kv_cache_dtype=kvd, kv_cache_memory=1 << 20))
              .get_stats().num_total_blocks for kvd in ("auto", "int8")}
    assert blocks["int8"] >= 1.9 * blocks["auto"]


def _generate(engine, prompts, tokens=12):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{engine.num_steps}-{i}", p, SamplingParams(temperature=0, max_tokens=tokens))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[k] for k in sorted(out, key=lambda r: int(r.rsplit("-", 1)[1]))]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prefix_cache_hit_on_int8_blocks_gives_the_output_of_a_recomputation(tiny_llama, make_engine, backend):
    prompt = list(range(3, 40))   # two full blocks of 16 are cached
    cached = make_engine(tiny_llama, dtype="bfloat16", kv_cache_dtype="int8", attention_backend=backend,
                         block_size=16)
    assert cached.kv_pool.tensor.dtype == torch.int8
    first = _generate(cached, [prompt])
    again = _generate(cached, [prompt + [7]])
    assert cached.get_stats().prefix_cache_hit_tokens == 32
    fresh = make_engine(tiny_llama, dtype="bfloat16", kv_cache_dtype="int8", attention_backend=backend, block_size=16,
                        enable_prefix_caching=False)
    assert _generate(fresh, [prompt]) == first and _generate(fresh, [prompt + [7]]) == again


def test_int8_engine_stays_close_to_the_float_kv_engine(tiny_llama, make_engine):
    """Teacher-forced logits with int8 KV vs float32 KV on the same weights."""
    ids = list(range(5, 60))
    logits = {}
    for kvd in ("auto", "int8"):
        engine = make_engine(tiny_llama, dtype="float32", kv_cache_dtype=kvd)
        logits[kvd] = prefill_logits(engine, ids, list(range(4)))
    p, q = logits["auto"].log_softmax(-1), logits["int8"].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max() < 1e-3 and not torch.equal(logits["auto"], logits["int8"])


def test_engine_args_knob():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model="x", kv_cache_dtype="fp8")


# ---- KV transfer ----------------------------------------------------------------------------------------

SHAPE = (2, 2, 16, 4, 2, 32 + 2)   # an int8 pool [layers, k|v, blocks, ...]: head_dim 32 + the fp16 scale


def _int8_pool(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(*SHAPE[:-1], 32, generator=g))


def test_layout_of_an_int8_pool_counts_its_scale_bytes_and_names_both_dtypes_on_mismatch():
    layout = KVLayout.of(_int8_pool(0))
    assert (layout.dtype, layout.head_dim, layout.scale_bytes) == ("int8", 32, 2)
    assert layout.layer_bytes == 2 * 4 * 2 * 34 and layout.shape == SHAPE
    assert KVLayout.from_dict(layout.to_dict()) == layout
    bf16 = KVLayout.of(torch.zeros(2, 2, 16, 4, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(LayoutMismatchError, match=r"dtype: sender 'bfloat16' vs receiver 'int8'.*scale_bytes"):
        layout.check_compatible(bf16)


@pytest.fixture
def int8_receiver():
    shm = SharedKVPool.create(SHAPE, torch.int8)
    rx = KVReceiver(shm.tensor, host="127.0.0.1", shm_name=shm.name)
    yield rx, shm.tensor
    rx.close()
    shm.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend, quant", [("shm", None), ("tcp", None), ("tcp", "int8")])
def test_int8_blocks_travel_byte_identical_with_their_scales(int8_receiver, backend, quant):
    """tcp with quant="int8" too: an int8 pool is never requantized for the wire."""
    rx, pool = int8_receiver
    src = _int8_pool(1)
    sender = KVSender(src, backend=backend, quant=quant)
    try:
        dst = rx.reserve("r", [9, 2, 3, 15])
        t = sender.start(dst.to_dict(), [0, 5, 6, 1])
        t.send_layers(0, 1)
        t.send_layers(1, 2)
        checksum = t.finish(timeout=10)
        result = asyncio.run(rx.wait("r", 10))
    finally:
        sender.close()
    assert result.ok and result.checksum == checksum
    assert torch.equal(blocks_of(pool, [9, 2, 3, 15]), blocks_of(src, [0, 5, 6, 1]))
    assert not blocks_of(pool, [b for b in range(16) if b not in (9, 2, 3, 15)]).any()


@pytest.mark.slow
def test_int8_decode_pool_refuses_a_bf16_prefill_sender_naming_both_dtypes(int8_receiver):
    """Refused by the sender against the receiver's advertised layout and, if it were skipped (a stale or forged
    destination), by the receiver's handshake."""
    rx, pool = int8_receiver
    bf16 = torch.zeros(2, 2, 16, 4, 2, 32, dtype=torch.bfloat16)
    sender = KVSender(bf16, backend="tcp")
    try:
        dst = rx.reserve("r", [1]).to_dict()
        with pytest.raises(LayoutMismatchError, match=r"dtype: receiver 'int8' vs sender 'bfloat16'"):
            sender.start(dst, [0])
        dst["layout"] = KVLayout.of(bf16).to_dict()
        with pytest.raises(TransferError, match=r"dtype: sender 'bfloat16' vs receiver 'int8'"):
            sender.start(dst, [0]).finish(timeout=10)
    finally:
        sender.close()
        rx.cancel("r")
    with pytest.raises(TransferError, match="cancelled"):
        asyncio.run(rx.wait("r", 10))
    assert not pool.any()
