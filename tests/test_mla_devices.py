"""MLA decode on devices: the emulated operators against plain references (torch_npu._npu_paged_attention_mla as its
op-plugin test computes it, test/test_custom_ops/test_atb_paged_attention_mla.py; FlashInfer's
BatchMLAPagedAttentionWrapper as MLA attention over the concatenated latent row), their documented restrictions, and
the NPU and FlashInfer MLA backends (engine/attention/mla_npu.py, mla_flashinfer.py) against the torch absorbed
decode of engine/attention/mla.py on the latent pool layout (one row per token: c_kv then k_pe).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import make_prompts, run_all
from flashinfer_emulator import emulated_flashinfer
from npu_emulator import emulated_torch_npu

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.testing import make_tiny_model


@pytest.fixture
def npu():
    with emulated_torch_npu() as torch_npu:
        yield torch_npu


@pytest.fixture
def flashinfer():
    with emulated_flashinfer() as fi:
        yield fi


def ref_latent_decode(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lens: list[int], scale: float,
                      v_dim: int) -> torch.Tensor:
    """q [B, N, row] (absorbed q_nope then q_pe); cache [blocks, block_size, 1, row]: each request's rows are its
    keys, their first v_dim values its values. Float64, request by request."""
    bs = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys = torch.stack([cache[table[t // bs], t % bs, 0] for t in range(n)]).double()
        p = torch.softmax(q[b].double() @ keys.t() * scale, dim=-1)
        out[b] = p @ keys[:, :v_dim]
    return out


def random_latent(num_blocks: int, block_size: int, row: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, 1, row, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    return cache, perm


# ------------------------------------------------------------------------------------- operator tests


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_npu_paged_attention_mla_matches_the_reference(npu, dtype):
    heads, rank, rope, bs = 4, 512, 64, 128   # DeepSeek's 512 + 64 latent row
    cache, perm = random_latent(6, bs, rank + rope, dtype, seed=1)
    lens = [1, 130, 300]
    tables = [perm[:1], perm[1:3], perm[3:6]]
    q = torch.randn(3, heads, rank + rope).to(dtype)
    out = torch.empty(3, heads, rank, dtype=dtype)
    scale = (128 + 64) ** -0.5
    npu._npu_paged_attention_mla(q, cache, 1, heads, scale, torch.tensor([t + [0] * (3 - len(t)) for t in tables],
                                 dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), rank, out)
    torch.testing.assert_close(out.double(), ref_latent_decode(q, cache, tables, lens, scale, rank),
                               rtol=2e-2, atol=2e-3)
    assert npu._emulator.calls["_npu_paged_attention_mla"] == 1


def test_npu_paged_attention_mla_restrictions(npu):
    q, cache = torch.randn(1, 4, 576).half(), torch.randn(2, 128, 1, 576).half()
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    out = torch.empty(1, 4, 512, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="MQA"):
        npu._npu_paged_attention_mla(q, cache, 2, 4, 1.0, table, lens, 512, out)
    with pytest.raises(RuntimeError, match="<= 128"):
        npu._npu_paged_attention_mla(q, torch.randn(1, 256, 1, 576).half(), 1, 4, 1.0, table, lens, 512, out)
    with pytest.raises(RuntimeError, match=r"\(0, 576\]"):
        npu._npu_paged_attention_mla(torch.randn(1, 4, 640).half(), torch.randn(2, 128, 1, 640).half(), 1, 4, 1.0,
                                     table, lens, 512, out)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        npu._npu_paged_attention_mla(q.float(), cache.float(), 1, 4, 1.0, table, lens, 512, out.float())
    with pytest.raises(RuntimeError, match="int32"):
        npu._npu_paged_attention_mla(q, cache, 1, 4, 1.0, table.long(), lens, 512, out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_mla_wrapper_matches_the_reference(flashinfer, dtype):
    heads, rank, rope, page = 8, 128, 64, 16
    cache, perm = random_latent(12, page, rank + rope, dtype, seed=2)
    lens = [1, 17, 70]
    tables = [perm[:1], perm[1:3], perm[3:8]]
    q = torch.randn(3, heads, rank + rope).to(dtype)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.int8))
    as_int32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.plan(as_int32([0, 1, 2, 3]), as_int32([0, 1, 3, 8]), as_int32([i for t in tables for i in t]),
                 as_int32(lens), heads, rank, rope, page, False, 0.1, dtype, dtype)
    ckv, kpe = cache[:, :, 0, :rank], cache[:, :, 0, rank:]   # strided slices of the one latent row
    out = wrapper.run(q[..., :rank].contiguous(), q[..., rank:].contiguous(), ckv, kpe)
    torch.testing.assert_close(out.double(), ref_latent_decode(q, cache, tables, lens, 0.1, rank),
                               rtol=2e-2, atol=2e-3)
    with pytest.raises(ValueError, match="does not match the planned"):
        wrapper.run(q[..., :rank].float(), q[..., rank:].contiguous(), ckv, kpe)
    with pytest.raises(ValueError, match="multiple of 64"):
        wrapper.plan(as_int32([0, 1]), as_int32([0, 1]), as_int32([0]), as_int32([1]), heads, 96, rope, page,
                     False, 0.1, dtype, dtype)
    with pytest.raises(RuntimeError, match="plan"):
        flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.int8)).run(q, q, ckv, kpe)


# ------------------------------------------------------------------ backends vs the torch absorbed decode


def mla_step(heads: int, rank: int, rope: int, nope: int, v_dim: int, block_size: int, dtype: torch.dtype,
             seed: int, int8: bool = False):
    """A latent pool layer (int8: rows quantized, their scale appended) with three decoding sequences (context
    lengths sorted, as the runner sorts them) and one prefill chunk after cached tokens: the inputs of
    MLAAttentionBackend.forward and the step's metadata."""
    from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
    from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
    from pdcluster.engine.kv_cache import quantize_rows

    g = torch.Generator().manual_seed(seed)
    num_blocks = 16
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=g).to(dtype)
    if int8:
        cache = quantize_rows(cache)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    lens = [3, block_size + 5, 2 * block_size + 7]          # decode rows (their new token included)
    tables = torch.stack([perm[0:3], perm[3:6], perm[6:9]])
    cached, new = block_size + 2, 5                          # the chunk: cached tokens, then 5 new ones
    chunk_table = perm[9:12]
    slots = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size for b, n in enumerate(lens)]
    slots += [int(chunk_table[t // block_size]) * block_size + t % block_size for t in range(cached, cached + new)]
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int32), 3, tables, torch.tensor(lens, dtype=torch.int32),
                             [PrefillChunk(3, 3 + new, cached, chunk_table)])
    t = 3 + new
    inputs = dict(q_nope=torch.randn(t, heads, nope, generator=g).to(dtype),
                  q_pe=torch.randn(t, heads, rope, generator=g).to(dtype),
                  c_kv=torch.randn(t, rank, generator=g).to(dtype), k_pe=torch.randn(t, rope, generator=g).to(dtype),
                  kv_b_weight=(torch.randn(heads, nope + v_dim, rank, generator=g) / rank ** 0.5).to(dtype))
    return cache, inputs, TorchAttentionBackend.prepare(meta)


def run_both(backend_cls, heads, rank, rope, block_size, dtype, seed=0, int8=False):
    from pdcluster.engine.attention.mla import MLAAttentionBackend

    nope, v_dim = 32, 48
    cache, inputs, meta = mla_step(heads, rank, rope, nope, v_dim, block_size, dtype, seed, int8)
    args = (heads, rank, rope, nope, v_dim, (nope + rope) ** -0.5)
    ref_cache, dev_cache = cache.clone(), cache.clone()
    want = MLAAttentionBackend(*args).forward(latent_cache=ref_cache, meta=meta, **inputs)
    got = backend_cls(*args).forward(latent_cache=dev_cache, meta=meta, **inputs)
    assert torch.equal(ref_cache, dev_cache)   # the same latent rows written
    return got, want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank, rope, block_size", [(512, 64, 128), (64, 32, 16)])
def test_npu_mla_backend_matches_the_torch_decode(dtype, rank, rope, block_size):
    with emulated_torch_npu() as npu:
        from pdcluster.engine.attention.mla_npu import NpuMLABackend

        got, want = run_both(NpuMLABackend, 4, rank, rope, block_size, dtype)
        assert npu._emulator.calls["_npu_paged_attention_mla"] == 1
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_npu_mla_backend_leaves_what_the_operator_refuses_to_torch():
    """A block of 256 with a 576-value row (ATB: at most 128 there), a float32 model and an int8 latent pool run
    the torch decode."""
    with emulated_torch_npu() as npu:
        from pdcluster.engine.attention.mla_npu import NpuMLABackend

        for args in ((512, 64, 256, torch.float16), (64, 32, 16, torch.float32)):
            got, want = run_both(NpuMLABackend, 4, *args)
            torch.testing.assert_close(got, want)
        got, want = run_both(NpuMLABackend, 4, 64, 32, 16, torch.float16, int8=True)
        torch.testing.assert_close(got, want)
        assert npu._emulator.calls["_npu_paged_attention_mla"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flashinfer_mla_backend_matches_the_torch_decode(dtype):
    with emulated_flashinfer(float32=dtype == torch.float32) as fi:
        from pdcluster.engine.attention.mla_flashinfer import FlashInferMLABackend

        got, want = run_both(FlashInferMLABackend, 8, 128, 64, 16, dtype)
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.run"] == 1
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_flashinfer_mla_backend_plans_once_per_step_and_falls_back():
    """Layers of one step share one plan; a latent rank the kernel's tiles do not fit (32) and an int8 latent pool
    run the torch decode."""
    with emulated_flashinfer() as fi:
        from pdcluster.engine.attention.mla_flashinfer import FlashInferMLABackend

        cache, inputs, meta = mla_step(8, 128, 64, 32, 48, 16, torch.bfloat16, seed=1)
        for _ in range(3):   # three layers
            FlashInferMLABackend(8, 128, 64, 32, 48, 0.1).forward(latent_cache=cache.clone(), meta=meta, **inputs)
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.plan"] == 1
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.run"] == 3
        for rank, int8 in ((32, False), (128, True)):
            got, want = run_both(FlashInferMLABackend, 8, rank, 64, 16, torch.bfloat16, int8=int8)
            torch.testing.assert_close(got, want)
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.run"] == 3


# --------------------------------------------------------------------------------------- whole engines


PROMPTS = make_prompts([5, 130, 1], seed=1)   # a full 128-token block, a chunked prompt (128-token budget)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_deepseek_v3_on_npu_is_token_exact_with_the_torch_mla(tmp_path, make_engine):
    """float16, every NPU path (the MLA decode through _npu_paged_attention_mla, the MoE operators) against the same
    engine with the cpu attention backend (mla.py's torch decode)."""
    model = make_tiny_model(str(tmp_path), "deepseek_v3")
    kw = dict(device="npu", dtype="float16", num_gpu_blocks_override=32, max_num_batched_tokens=128)
    with emulated_torch_npu(npu_on_cpu=True) as npu:
        engine = make_engine(model, **kw)
        assert type(engine.runner.attn_backend).__name__ == "NpuMLABackend"
        got = run_all(engine, PROMPTS, GREEDY)
        assert npu._emulator.calls["_npu_paged_attention_mla"]
        assert run_all(make_engine(model, attention_backend="cpu", **kw), PROMPTS, GREEDY) == got


def test_deepseek_v3_on_flashinfer_mla_is_token_exact(tmp_path, make_engine):
    """float32 through the emulator's switch, a latent of 64 + 64 (the kernel's tiles), against a CPU engine."""
    model = make_tiny_model(str(tmp_path), "deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=64)
    with emulated_flashinfer(float32=True) as fi:
        engine = make_engine(model, attention_backend="flashinfer")
        assert type(engine.runner.attn_backend).__name__ == "FlashInferMLABackend"
        got = run_all(engine, PROMPTS, GREEDY)
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.run"]
        layers = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
        # one plan per step with decode rows, shared by the layers
        assert fi._emulator.calls["BatchMLAPagedAttentionWrapper.plan"] * layers == \
            fi._emulator.calls["BatchMLAPagedAttentionWrapper.run"]
    assert run_all(make_engine(model), PROMPTS, GREEDY) == got
