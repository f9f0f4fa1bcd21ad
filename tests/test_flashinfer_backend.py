"""The CUDA attention backend (`attention_backend="flashinfer"`) on the FlashInfer emulator (tests/fake_flashinfer),
on CPU tensors: the emulated APIs against plain references and their documented restrictions, then whole engines
token-exact with the reference backends (fp32 greedy; continuous batching, chunked prefill, prefix-cache hits,
preemption, sliding windows with released blocks, GQA / MQA), plans built once per step, and the dtypes FlashInfer
has no kernels for running the torch path. The last test runs on a CUDA GPU with the real flashinfer only."""

from __future__ import annotations

import pytest
import torch
from conftest import checked_engine
from engine_helpers import GREEDY, make_prompts, run_all, run_staggered
from flashinfer_emulator import emulated_flashinfer, flashinfer_emulator_fixture  # noqa: F401

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.attention import get_backend_class
from pdcluster.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from pdcluster.engine.testing import make_tiny_model, prefill_logits

CPU = torch.device("cpu")


# ---- the emulator against plain references ---------------------------------------------------------------------

def reference(q, k_rows, v_rows, q_positions, window_left=-1):
    """Attention of q [n, Hq, D] at absolute q_positions over keys k_rows/v_rows [L, Hkv, D] (positions 0..L-1)."""
    g = q.shape[1] // k_rows.shape[1]
    k, v = k_rows.float().repeat_interleave(g, 1), v_rows.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / q.shape[-1] ** 0.5
    pos = torch.arange(k.shape[0])[None, :]
    qp = torch.tensor(q_positions)[:, None]
    visible = pos <= qp
    if window_left >= 0:
        visible &= pos >= qp - window_left
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), v)


def paged(num_pages=12, page_size=4, hkv=2, d=8, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    return k, v


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def workspace():
    return torch.empty(1 << 20, dtype=torch.uint8)


def rows(cache, pages, n):
    return cache[pages].flatten(0, 1)[:n]


@pytest.mark.parametrize("window_left", [-1, 3])
def test_prefill_append_attention_gqa_causal_window(flashinfer_emulator, window_left):
    fi = flashinfer_emulator
    k, v = paged()
    q = torch.randn(7, 4, 8).half()
    # request 0: 3 new rows after 6 cached (kv 9, pages 5,2,7); request 1: 4 rows from scratch (pages 0)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(i32([0, 3, 7]), i32([0, 3, 4]), i32([5, 2, 7, 0]), i32([1, 4]), 4, 2, 8, 4, causal=True,
           window_left=window_left, q_data_type=torch.float16)
    out = w.run(q, (k, v))
    assert out.shape == (7, 4, 8) and out.dtype == torch.float16
    want0 = reference(q[:3], rows(k, [5, 2, 7], 9), rows(v, [5, 2, 7], 9), [6, 7, 8], window_left)
    want1 = reference(q[3:], rows(k, [0], 4), rows(v, [0], 4), [0, 1, 2, 3], window_left)
    torch.testing.assert_close(out.float(), torch.cat([want0, want1]), atol=2e-3, rtol=2e-3)
    assert w.run(q, (k, v)).equal(out)   # one plan, many runs (one per layer)


def test_decode_gqa_window_and_5d_cache(flashinfer_emulator):
    fi = flashinfer_emulator
    k, v = paged(dtype=torch.bfloat16)
    q = torch.randn(2, 4, 8).bfloat16()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
    w.plan(i32([0, 2, 5]), i32([3, 1, 4, 6, 8]), i32([2, 4]), 4, 2, 8, 4, window_left=4,
           q_data_type=torch.bfloat16)
    out = w.run(q, torch.stack([k, v], dim=1))   # one [pages, 2, page_size, H, D] tensor
    want = torch.cat([reference(q[:1], rows(k, [3, 1], 6), rows(v, [3, 1], 6), [5], 4),
                      reference(q[1:], rows(k, [4, 6, 8], 12), rows(v, [4, 6, 8], 12), [11], 4)])
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_batch_indices_positions_and_append_follow_the_docs_example(flashinfer_emulator):
    fi = flashinfer_emulator
    b, p = fi.get_batch_indices_positions(i32([0, 1, 3, 6, 10]), i32([5, 5, 5, 5]), 10)
    assert b.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3] and p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    assert b.dtype == p.dtype == torch.int32
    k, v = paged()
    k0, v0 = k.clone(), v.clone()
    new_k, new_v = torch.randn(3, 2, 8).half(), torch.randn(3, 2, 8).half()
    # request 0 (pages 5, 2; 6 entries) gets positions 4, 5; request 1 (page 9; 1 entry) position 0
    fi.append_paged_kv_cache(new_k, new_v, i32([0, 0, 1]), i32([4, 5, 0]), (k, v), i32([5, 2, 9]), i32([0, 2, 3]),
                             i32([2, 1]))
    assert k[2, 0].equal(new_k[0]) and k[2, 1].equal(new_k[1]) and v[9, 0].equal(new_v[2])
    k0[2, :2], k0[9, 0] = new_k[:2], new_k[2]
    v0[2, :2], v0[9, 0] = new_v[:2], new_v[2]
    assert k.equal(k0) and v.equal(v0)   # nothing else written


def _prefill_plan_args(**changes):
    args = dict(qo_indptr=i32([0, 3]), paged_kv_indptr=i32([0, 1]), paged_kv_indices=i32([0]),
                paged_kv_last_page_len=i32([3]), num_qo_heads=4, num_kv_heads=2, head_dim_qk=8, page_size=4,
                causal=True, q_data_type=torch.float16)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,match", [
    (dict(paged_kv_indices=torch.tensor([0])), ValueError, "int32"),
    (dict(paged_kv_last_page_len=i32([5])), ValueError, "1 <= last_page_len <= page_size"),
    (dict(paged_kv_indptr=i32([0, 1, 1])), ValueError, r"batch_size \+ 1"),
    (dict(num_qo_heads=3), ValueError, "multiple of num_kv_heads"),
    (dict(q_data_type=torch.float32), ValueError, "float16 or bfloat16"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError, "pos_encoding_mode"),
    (dict(pos_encoding_mode="XPOS"), KeyError, "pos_encoding_mode"),
    (dict(qo_indptr=i32([0, 5])), ValueError, "qo_len 5 > kv_len 3"),
])
def test_plan_restrictions(flashinfer_emulator, changes, error, match):
    w = flashinfer_emulator.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    with pytest.raises(error, match=match):
        w.plan(**_prefill_plan_args(**changes))


def test_run_restrictions(flashinfer_emulator):
    fi = flashinfer_emulator
    k, v = paged()
    q = torch.randn(3, 4, 8).half()
    with pytest.raises(KeyError, match="kv_layout"):
        fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NDH")
    with pytest.raises(ValueError, match="16-byte aligned"):
        fi.BatchPrefillWithPagedKVCacheWrapper(workspace()[1:], "NHD")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, (k, v))
    w.plan(**_prefill_plan_args())
    with pytest.raises(ValueError, match="dtype of q"):
        w.run(q.bfloat16(), (k, v))
    with pytest.raises(ValueError, match="dtype of k"):
        w.run(q, (k.bfloat16(), v.bfloat16()))
    with pytest.raises(ValueError, match="does not match"):
        w.run(q[:2], (k, v))
    with pytest.raises(ValueError, match="strides must be identical"):
        w.run(q, (k, v.transpose(0, 1).contiguous().transpose(0, 1)))
    with pytest.raises(ValueError, match="page_size"):
        w.run(q, (k[:, :2], v[:, :2]))
    with pytest.raises(AssertionError, match="window_left"):
        w.run(q, (k, v), window_left=2)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        w.run(torch.randn(3, 8, 4).half().transpose(1, 2), (k, v))
    assert w.run(q, (k, v)).shape == (3, 4, 8)


def test_float32_needs_the_emulator_switch():
    with emulated_flashinfer(float32=False) as fi:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            w.plan(i32([0, 1]), i32([0]), i32([1]), 4, 2, 8, 4, q_data_type=torch.float32)
    with emulated_flashinfer(float32=True) as fi:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        w.plan(i32([0, 1]), i32([0]), i32([1]), 4, 2, 8, 4, q_data_type=torch.float32)


# ---- the backend in the engine -------------------------------------------------------------------------------------

def test_auto_dtype_on_cuda_is_bfloat16_for_a_float32_checkpoint(tmp_path):
    from pdcluster.engine.config import resolve_dtype

    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    assert resolve_dtype("auto", torch.device("cuda", 0), str(tmp_path)) == torch.bfloat16
    assert resolve_dtype("auto", CPU, str(tmp_path)) == torch.float32


def test_default_backend_on_cuda_is_flashinfer_when_it_imports(monkeypatch):
    with emulated_flashinfer():
        assert get_backend_class(None, "cuda") is FlashInferAttentionBackend
        assert get_backend_class(None, "cpu").name == "cpu"
    import pdcluster.engine.attention as registry

    monkeypatch.setattr(registry, "_flashinfer_imports", lambda: False)
    assert get_backend_class(None, "cuda").name == "torch"


def _tokens(model, prompts, backend, params, mode="staggered", **kw):
    """Greedy outputs of a leak-checked fp32 CPU engine on `backend` and its stats; prompts submitted staggered,
    all together, or one after another (each one's prefix then cached for the next)."""
    with checked_engine(model, device="cpu", dtype="float32", attention_backend=backend, **kw) as engine:
        if mode == "staggered":
            got = run_staggered(engine, prompts, params)
            out = [got[str(i)] for i in range(len(prompts))]
        elif mode == "together":
            out = run_all(engine, prompts, params)
        else:
            out = [run_all(engine, [p], params, prefix=f"p{i}-")[0] for i, p in enumerate(prompts)]
        return out, engine.get_stats()


def _engine_logits(engine, ids):
    return prefill_logits(engine, ids).cpu()


@pytest.mark.slow   # two engines per case (~3-5 s idle, more on a loaded box)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_engine_token_exact_with_chunked_prefill(arch, tiny_models, make_engine):
    """GQA (llama), QKV bias (qwen2), MQA (mistral); staggered arrivals, prompts cut into 48-token chunks that
    attend to their cached context: tokens equal the torch reference backend's; one plan per step, not per layer."""
    prompts = make_prompts([1, 3, 17, 40, 100, 33, 129])
    want, _ = _tokens(tiny_models[arch], prompts, "torch", GREEDY, max_num_batched_tokens=48)
    with emulated_flashinfer(float32=True) as fi:
        engine = make_engine(tiny_models[arch], device="cpu", attention_backend="flashinfer",
                             max_num_batched_tokens=48)
        got = run_staggered(engine, prompts)
        calls = fi._emulator.calls
    assert [got[str(i)] for i in range(len(prompts))] == want
    layers = engine.model_config.num_layers
    for kind in ("Decode", "Prefill"):
        name = f"Batch{kind}WithPagedKVCacheWrapper"
        plans, runs = calls[f"{name}.plan"], calls[f"{name}.run"]
        assert plans > 0 and runs == layers * plans
    assert calls["get_batch_indices_positions"] == engine.get_stats().num_steps
    assert calls["append_paged_kv_cache"] == layers * engine.get_stats().num_steps


@pytest.mark.slow   # two engines per case (~3-5 s idle, more on a loaded box)
def test_engine_prefix_cache_hits_and_preemption(tiny_qwen2, tiny_mistral):
    shared = make_prompts([70], seed=11)[0]
    prompts = [shared + t for t in make_prompts([1, 9, 40, 20], seed=12)] + [shared]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _tokens(tiny_qwen2, prompts, "cpu", params, "one_by_one", block_size=16)
    with emulated_flashinfer(float32=True):
        got, stats = _tokens(tiny_qwen2, prompts, "flashinfer", params, "one_by_one", block_size=16)
    assert got == want and stats.prefix_cache_hit_tokens >= 4 * 64
    prompts = make_prompts([60, 45, 70, 30, 50, 64], seed=21)
    small = dict(num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=256)
    want, _ = _tokens(tiny_mistral, prompts, "cpu", params, "together", **small)
    with emulated_flashinfer(float32=True):
        got, stats = _tokens(tiny_mistral, prompts, "flashinfer", params, "together", **small)
    assert got == want and stats.num_preemptions > 0


@pytest.mark.parametrize("arch,config", [("mistral", dict(sliding_window=24)),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=20,
                                                        max_window_layers=1))])
def test_engine_sliding_windows(arch, config, tmp_path):
    """Mistral: every layer windowed, so blocks out of the window are released while requests run (the plans list
    each sequence's pages from the first its window sees); Qwen2: a full layer and a windowed one, two plans per
    step. Prompts and generations far past the window, with chunks shorter and longer than it."""
    model = make_tiny_model(str(tmp_path / arch), arch, seed=7, **config)
    prompts = make_prompts([300, 5, 70, 23, 129, 40], seed=31)
    prompts.append(prompts[0][:200] + [7, 8, 9])
    params = SamplingParams(temperature=0, max_tokens=48)
    kw = dict(block_size=8, max_num_batched_tokens=64)
    want, _ = _tokens(model, prompts, "cpu", params, **kw)
    with emulated_flashinfer(float32=True) as fi:
        pages = []   # pages per request of each windowed decode plan
        plan = fi.BatchDecodeWithPagedKVCacheWrapper.plan

        def spy(self, indptr, *args, window_left=-1, **kwargs):
            if window_left >= 0:
                pages.append(max((indptr[1:] - indptr[:-1]).tolist()))
            return plan(self, indptr, *args, window_left=window_left, **kwargs)

        fi.BatchDecodeWithPagedKVCacheWrapper.plan = spy
        got, stats = _tokens(model, prompts, "flashinfer", params, **kw)
        calls = dict(fi._emulator.calls)
    assert got == want and stats.prefix_cache_hit_tokens > 0
    plans, runs = calls["BatchDecodeWithPagedKVCacheWrapper.plan"], calls["BatchDecodeWithPagedKVCacheWrapper.run"]
    # 2 layers: one window shared by both (mistral) is one plan a step; a full and a windowed layer (qwen2), two
    assert runs == (2 * plans if arch == "mistral" else plans)
    # a decode row's window (itself and the window - 1 positions before it) spans at most
    # ceil((window - 1) / block_size) + 1 pages, however long the sequence (up to 348 tokens here)
    assert pages and max(pages) <= -(-(config["sliding_window"] - 1) // kw["block_size"]) + 1


def _bf16_errors(make_engine, model: str, device: str, ids: list[int]) -> tuple[float, float]:
    """How far the bf16 prefill logits of the flashinfer and the torch backends are from the fp32 reference's.
    (bf16 tokens of a tiny random model are no test: its logits are nearly flat, and the two backends round
    differently, so greedy picks diverge after a few tokens.)"""
    ref = _engine_logits(make_engine(model, device=device, dtype="float32", attention_backend="torch"), ids)
    fi = make_engine(model, device=device, dtype="bfloat16", attention_backend="flashinfer")
    assert isinstance(fi.runner.attn_backend, FlashInferAttentionBackend)
    errors = [(_engine_logits(e, ids) - ref).abs().max().item()
              for e in (fi, make_engine(model, device=device, dtype="bfloat16", attention_backend="torch"))]
    assert fi.runner.attn_backend.disabled is None, fi.runner.attn_backend.disabled   # FlashInfer's kernels ran
    return errors[0], errors[1]


def test_bf16_runs_flashinfer_and_fp32_int8_run_the_torch_path(tiny_llama, make_engine, caplog):
    prompts = make_prompts([5, 40, 17], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with emulated_flashinfer() as fi:   # as on hardware: no float32
        engine = make_engine(tiny_llama, device="cpu", dtype="bfloat16", attention_backend="flashinfer")
        assert [len(o) for o in run_all(engine, prompts, params)] == [8, 8, 8]
        assert fi._emulator.calls["BatchDecodeWithPagedKVCacheWrapper.run"] > 0
        err_fi, err_torch = _bf16_errors(make_engine, tiny_llama, "cpu", make_prompts([100], seed=4)[0])
        assert err_fi <= 1.5 * err_torch + 0.02, (err_fi, err_torch)   # as close to fp32 as the torch path
        fi._emulator.calls.clear()
        for kw in (dict(device="cpu", dtype="float32"), dict(device="cpu", dtype="float32", kv_cache_dtype="int8")):
            want = run_all(make_engine(tiny_llama, attention_backend="torch", **kw), prompts, params)
            assert run_all(make_engine(tiny_llama, attention_backend="flashinfer", **kw), prompts, params) == want
        assert not fi._emulator.calls                 # neither touched FlashInfer
    assert "running the torch reference path" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashinfer_on_cuda_matches_the_torch_backend(tmp_path, make_engine):
    """On a GPU with the real flashinfer-python (benchmarks/gpu_check.py runs it): the bf16 FlashInfer engine's
    prefill logits are as close to the fp32 reference as the bf16 torch backend's (compared on the CPU), and
    it generates. Head size 64 (GQA 4:2), one FlashInfer builds kernels for; the first run may JIT-compile."""
    pytest.importorskip("flashinfer")
    model = make_tiny_model(str(tmp_path / "hd64"), "llama", hidden_size=256, intermediate_size=256)
    err_fi, err_torch = _bf16_errors(make_engine, model, "cuda", make_prompts([100], seed=4)[0])
    assert err_fi <= 1.5 * err_torch + 0.02, (err_fi, err_torch)
    engine = make_engine(model, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                         max_num_batched_tokens=48)   # chunked prefill: chunks after cached context, and decode
    out = run_all(engine, make_prompts([5, 40, 17, 100], seed=3), SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
    assert [len(o) for o in out] == [8, 8, 8, 8]


def test_kernels_that_cannot_be_built_leave_the_torch_path(tiny_llama, make_engine, caplog):
    """A host where FlashInfer cannot build or load its kernels (JIT without nvcc, say) at their first use: the
    backend says so once and runs the torch path, token-exact; a call FlashInfer refuses still raises."""
    prompts = make_prompts([5, 40], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = run_all(make_engine(tiny_llama, device="cpu", attention_backend="torch"), prompts, params)
    with emulated_flashinfer(float32=True) as fi:
        def no_nvcc(*args, **kwargs):
            raise RuntimeError("Ninja build failed: nvcc not found")

        fi.BatchPrefillWithPagedKVCacheWrapper.plan = no_nvcc
        engine = make_engine(tiny_llama, device="cpu", attention_backend="flashinfer")
        assert run_all(engine, prompts, params) == want
        assert "nvcc not found" in engine.runner.attn_backend.disabled
        assert "could not be built or loaded" in caplog.text

        def refuse(*args, **kwargs):
            raise ValueError("paged_kv_indices must be int32")

        fi.BatchPrefillWithPagedKVCacheWrapper.plan = refuse
        engine = make_engine(tiny_llama, device="cpu", attention_backend="flashinfer")
        engine.add_request("x", prompts[0], params)
        with pytest.raises(ValueError, match="int32"):
            engine.step()
        engine.abort("x")
