"""The NPU path (`device="npu"`) end to end under the CPU emulator of torch_npu (tests/fake_torch_npu): engine
steps through the `npu` attention backend (`_npu_reshape_and_cache`, `npu_fused_infer_attention_score`) and the
fused layer ops (`npu_rms_norm` / `npu_add_rms_norm`, `npu_rotary_mul`, `npu_swiglu`), NPU defaults, per-thread
device binding, int8 KV through the antiquant parameters, and a prefill → decode KV transfer between two NPU
engines.

Precision: the fused attention takes float16 / bfloat16 only, so the comparisons run in float16 (bfloat16 runs
too: see test_bfloat16_runs_and_mostly_agrees). Token-exact means: the NPU engine against the same engine with
the `cpu` attention backend (the native decode kernel and the torch prefill), every other op the same. Against
a plain CPU engine the fused layer ops round once in float32 where the op-by-op torch math rounds after each op;
that is checked op by op (within one rounding step) rather than token by token.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from engine_helpers import make_prompts, run_all
from npu_emulator import emulated_torch_npu

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.kv_connector import KVConnector
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.testing import make_tiny_model

FUSED = ("npu_fused_infer_attention_score", "_npu_reshape_and_cache", "npu_rms_norm", "npu_add_rms_norm",
         "npu_rotary_mul", "npu_swiglu")
# a short prompt, a full block + change, chunked prompts (128-token budget), a one-token prompt
PROMPTS = make_prompts([5, 40, 130, 300, 1], seed=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float16", num_gpu_blocks_override=32, max_num_batched_tokens=128)


@pytest.fixture
def npu():
    with emulated_torch_npu(npu_on_cpu=True) as torch_npu:
        yield torch_npu


@pytest.fixture(scope="module")
def tiny_window(tmp_path_factory) -> str:
    """Mistral (one KV head) with a 40-token sliding window: prompts and generations run past it."""
    return make_tiny_model(str(tmp_path_factory.mktemp("mistral_w")), "mistral", sliding_window=40)


def _engines(make_engine, model: str, **kw):
    """(the NPU engine, the same engine with the cpu attention backend)."""
    return (make_engine(model, device="npu", **ENGINE, **kw),
            make_engine(model, device="npu", attention_backend="cpu", **ENGINE, **kw))


def _twice(engine) -> tuple[list[list[int]], int]:
    """Outputs of PROMPTS, then of the same prompts again (their full blocks now come from the prefix cache),
    and the prefix-cache hit tokens of the second round."""
    first = run_all(engine, PROMPTS, GREEDY, prefix="a")
    before = engine.get_stats().prefix_cache_hit_tokens
    second = run_all(engine, PROMPTS, GREEDY, prefix="b")
    return first + second, engine.get_stats().prefix_cache_hit_tokens - before


def test_npu_defaults_and_backend(npu, tiny_llama, make_engine):
    engine = make_engine(tiny_llama, device="npu", dtype="auto", num_gpu_blocks_override=8)
    assert type(engine.runner.attn_backend).__name__ == "NpuAttentionBackend"
    assert (engine.block_size, engine.dtype) == (128, torch.bfloat16)   # from block 16 / dtype auto
    with pytest.raises(ValueError, match="float32 does not run on NPU"):
        make_engine(tiny_llama, device="npu", dtype="float32", num_gpu_blocks_override=8)
    npu._emulator.bf16_supported = False
    assert make_engine(tiny_llama, device="npu", dtype="auto", num_gpu_blocks_override=8).dtype == torch.float16
    assert make_engine(tiny_llama, device="npu", block_size=256, dtype="float16",
                       num_gpu_blocks_override=8).block_size == 256   # explicit settings stay


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_npu_path_is_token_exact_with_the_cpu_backend(npu, model, kv_cache_dtype, request, make_engine):
    """Prefill, chunked prefill, decode, prefix-cache hits; float or int8 KV (int8 decode: antiquant mode 5)."""
    path = request.getfixturevalue(model)
    engine, reference = _engines(make_engine, path, kv_cache_dtype=kv_cache_dtype)
    npu._emulator.calls.clear()
    got, hits = _twice(engine)
    assert all(npu._emulator.calls[op] for op in FUSED), npu._emulator.calls
    assert hits >= 2 * 128   # the two longest prompts' first blocks
    want, _ = _twice(reference)
    assert got == want


@pytest.mark.slow
def test_sliding_window_on_npu_is_token_exact(npu, tiny_window, make_engine):
    """Decode windows as a mask (Q_S = 1), prefill windows as sparse_mode 4; released blocks stay unread."""
    engine, reference = _engines(make_engine, tiny_window)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    # (seed 2 puts an exact float16 tie between two tokens at one position, which the native kernel and the fused
    # attention break differently: no test of anything)
    prompts = make_prompts([300, 100, 3], seed=3)
    assert run_all(engine, prompts, params) == run_all(reference, prompts, params)


@pytest.mark.slow
def test_bfloat16_runs_and_mostly_agrees(npu, tiny_llama, make_engine):
    """bfloat16 (the NPU default) runs the same path; near-tied logits of a random model may flip a late token
    where the fused attention's single rounding differs from the CPU kernels'."""
    kw = dict(device="npu", dtype="auto", num_gpu_blocks_override=32, max_num_batched_tokens=128)
    engine, reference = make_engine(tiny_llama, **kw), make_engine(tiny_llama, attention_backend="cpu", **kw)
    assert engine.dtype == torch.bfloat16
    got, want = run_all(engine, PROMPTS, GREEDY), run_all(reference, PROMPTS, GREEDY)
    assert [g[0] for g in got] == [w[0] for w in want]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.8 * sum(len(w) for w in want)


def test_engine_thread_binds_the_device(npu, tiny_llama):
    """Ascend device contexts are per thread: a step from a thread that never called set_device fails as on
    hardware, and the engine's own thread binds itself."""
    from pdcluster.engine.async_engine import AsyncLLMEngine

    unbound = LLMEngine(EngineArgs(model=tiny_llama, device="npu", dtype="float16", num_gpu_blocks_override=8))
    unbound.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2))
    errors: list[BaseException] = []

    def step() -> None:
        try:
            unbound.step()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=step)
    t.start()
    t.join(60)
    assert errors and "The context is empty" in str(errors[0])
    engine = LLMEngine(EngineArgs(model=tiny_llama, device="npu", dtype="float16", num_gpu_blocks_override=8))
    aengine = AsyncLLMEngine(engine=engine)
    try:
        out = asyncio.run(aengine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3)))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        aengine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_prefill_to_decode_transfer_between_npu_engines(npu, tiny_llama, kv_cache_dtype, make_engine):
    """An npu prefill engine pushes each prompt's KV layer by layer (tcp, per-plane runs) into an npu decode
    engine's reserved blocks; the decode engine continues exactly as one engine would."""
    from pdcluster.kv_transfer import KVReceiver, KVSender

    kw = dict(device="npu", kv_cache_dtype=kv_cache_dtype, **ENGINE)
    reserved = {}

    class Reserved(KVConnector):
        def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
            reserved[request_id] = (block_ids, num_cached_tokens)

    prefill, decode, single = make_engine(tiny_llama, **kw), make_engine(tiny_llama, kv_connector=Reserved(), **kw), \
        make_engine(tiny_llama, **kw)
    prompts = PROMPTS[1:4]
    want = run_all(single, prompts, GREEDY)
    rx = KVReceiver(decode.kv_pool.tensor, host="127.0.0.1")
    sender = KVSender(prefill.kv_pool.tensor, backend="tcp")
    got = []
    try:
        for i, p in enumerate(prompts):
            assert decode.add_request(f"d{i}", p, GREEDY, remote_kv=True)
            blocks, cached = reserved[f"d{i}"]
            dst = rx.reserve(f"d{i}", blocks[cached // 128:])
            prefill.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=1), hold_blocks=True)
            out = None
            while out is None:
                out = next((o for o in prefill.step() if o.finished), None)
            transfer = sender.start(dst.to_dict(), out.block_ids[cached // 128:])
            for layer in range(prefill.model_config.num_layers):
                transfer.send_layers(layer, layer + 1)
            assert transfer.finish(timeout=30) == asyncio.run(rx.wait(f"d{i}", 30)).checksum
            prefill.abort(f"p{i}")
            tokens = list(decode.remote_kv_landed(f"d{i}", out.new_token_ids[0]).new_token_ids)
            while decode.has_unfinished_requests():
                for o in decode.step():
                    tokens += o.new_token_ids
            got.append(tokens)
    finally:
        sender.close()
        rx.close()
    assert got == want


def test_fused_layer_ops_match_the_cpu_math_within_one_rounding(npu):
    """The layers' NPU branches (selected by device: here the emulator's CPU stand-in) against their CPU math."""
    from pdcluster.engine.layers import layernorm, mlp, rotary

    torch.manual_seed(0)
    norm = layernorm.RMSNorm(64, 1e-6).half()
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x, res = torch.randn(5, 64).half(), torch.randn(5, 64).half()
    up = mlp.GatedMLP(64, 96)
    torch.nn.init.normal_(up.gate_up_proj.weight, 0, 0.1)
    torch.nn.init.normal_(up.down_proj.weight, 0, 0.1)
    up = up.half()
    rope = rotary.RotaryEmbedding(16, 64, 10000.0, None, torch.float16)
    cos, sin = rope.lookup(torch.arange(5))
    qk = torch.randn(5, 3, 16).half()
    calls = dict(npu._emulator.calls)
    fused = (norm(x), norm(x, res), up(x), rotary.apply_rotary(qk, cos, sin))
    assert all(npu._emulator.calls[op] > calls.get(op, 0) for op in FUSED[2:])
    npu._emulator.npu_on_cpu = False
    plain = (norm(x), norm(x, res), up(x), rotary.apply_rotary(qk, cos, sin))
    for a, b in zip(torch.utils._pytree.tree_leaves(fused), torch.utils._pytree.tree_leaves(plain), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=2e-3)


def test_kv_pool_leaves_room_for_hccl_buffers(monkeypatch):
    from pdcluster.engine.device import HCCL_COMMUNICATORS, collective_headroom_bytes

    assert collective_headroom_bytes(torch.device("cpu")) == 0
    monkeypatch.setenv("HCCL_BUFFSIZE", "64")

    class Npu:   # only the device type matters
        type = "npu"

    assert collective_headroom_bytes(Npu()) == 2 * 64 * HCCL_COMMUNICATORS << 20
    monkeypatch.delenv("HCCL_BUFFSIZE")
    assert collective_headroom_bytes(Npu()) == 2 * 200 * HCCL_COMMUNICATORS << 20
