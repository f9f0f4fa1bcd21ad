"""The device paths of the batched LoRA delta (engine/lora/layers.py `LoRALayer.add_`) against the masked path,
under emulators written from the vendors' contracts: NPU through vLLM-Ascend's bgmv/sgmv custom ops
(engine/lora/npu_ops.py; emulated in tests/fake_torch_npu/vllm_ascend), CUDA through FlashInfer's segment GEMM
(engine/lora/cuda_ops.py; emulated in tests/fake_flashinfer/flashinfer/gemm.py). Tensors stay on CPU.

Precision: the device paths take float16 / bfloat16; the reference is the masked path in float32 on the same
(rounded) weights, so they agree within the output dtype's rounding."""

from __future__ import annotations

import sys

import pytest
import torch
from engine_helpers import make_prompts
from flashinfer_emulator import emulated_flashinfer
from lora_helpers import ALL_TARGETS, make_adapter
from npu_emulator import emulated_torch_npu

from pdcluster import LoRARequest, SamplingParams
from pdcluster.engine.lora import npu_ops
from pdcluster.engine.lora.layers import LoRALayer, choose_kind
from pdcluster.engine.lora.step import LoRAStep
from pdcluster.engine.testing import make_tiny_model

IN, SHARDS, SLOTS = 64, [48, 32, 32], 4
CPU = torch.device("cpu")
# one slot per token, adapters interleaved with base-model tokens (-1): a decode step (bgmv)
DECODE = [2, -1, 0, 1, 3, -1, 2, 0]
# runs of tokens per adapter, the same adapter in two places, base tokens between: a prefill step (sgmv)
PREFILL = [0] * 5 + [-1] * 3 + [2] * 4 + [0] * 2 + [1] * 6 + [3]
TOL = {torch.float16: dict(atol=4e-3, rtol=4e-3), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _adapters(rank: int, dtype: torch.dtype, seed: int = 0) -> dict[tuple[int, int], tuple[torch.Tensor, ...]]:
    """(slot, shard) -> (A [r, in], B [out, r]) rounded to `dtype`: ranks rank, rank / 2, 1, rank; slot 1 leaves
    the first shard out."""
    g = torch.Generator().manual_seed(seed)
    ab = {}
    for slot, r in enumerate([rank, rank // 2, 1, rank]):
        for shard, out in enumerate(SHARDS):
            if (slot, shard) != (1, 0):
                ab[slot, shard] = ((torch.randn(r, IN, generator=g) * 0.1).to(dtype),
                                   (torch.randn(out, r, generator=g) * 0.5).to(dtype))
    return ab


def _layer(kind: str | None, dtype: torch.dtype, rank: int, ab) -> LoRALayer:
    layer = LoRALayer(LoRAStep(), IN, SHARDS, SLOTS, rank, dtype, CPU, kind=kind)
    for slot in range(SLOTS):
        for shard in range(len(SHARDS)):
            layer.set_slot(slot, shard, *ab.get((slot, shard), (None, None)))
    return layer


def _delta(layer: LoRALayer, slots: list[int], x: torch.Tensor, split: bool) -> torch.Tensor:
    layer.step.begin(torch.tensor(slots, dtype=torch.int32), {layer.kind}, layer.rank, layer.a.dtype, CPU)
    x = x.to(layer.a.dtype)
    if split:   # GatedMLP's form: each shard's output its own tensor
        parts = [torch.zeros(len(slots), n, dtype=x.dtype) for n in SHARDS]
        layer.add_(x, parts)
        return torch.cat(parts, dim=1)
    out = torch.zeros(len(slots), sum(SHARDS), dtype=x.dtype)
    layer.add_(x, out)
    return out


def _reference(slots: list[int], x: torch.Tensor, rank: int, ab) -> torch.Tensor:
    """The masked path in float32 on the same weights."""
    ab32 = {k: (a.float(), b.float()) for k, (a, b) in ab.items()}
    return _delta(_layer("masked", torch.float32, rank, ab32), slots, x, split=False)


# ---- NPU: vLLM-Ascend's bgmv / sgmv ops -------------------------------------------------------------------------


@pytest.fixture
def npu():
    with emulated_torch_npu(npu_on_cpu=True) as torch_npu:
        yield torch_npu


@pytest.mark.parametrize("dtype,rank", [(torch.float16, 8), (torch.bfloat16, 16), (torch.float16, 32)])
@pytest.mark.parametrize("split", [False, True])
def test_npu_delta_equals_masked(npu, dtype, rank, split):
    ab = _adapters(rank, dtype)
    x = torch.randn(len(PREFILL), IN, generator=torch.Generator().manual_seed(1))
    layer = _layer(None, dtype, rank, ab)
    assert layer.kind == "npu" and tuple(layer.a.shape) == (3, SLOTS, rank, IN)
    for slots, ops in [(DECODE, "bgmv"), (PREFILL, "sgmv")]:
        npu._emulator.calls.clear()
        got = _delta(layer, slots, x[:len(slots)], split)
        want = _reference(slots, x[:len(slots)], rank, ab)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
        other = "sgmv" if ops == "bgmv" else "bgmv"
        assert npu._emulator.calls[f"{ops}_shrink"] == npu._emulator.calls[f"{ops}_expand"] == len(SHARDS)
        assert npu._emulator.calls[f"{other}_shrink"] == 0
        base = [t for t, s in enumerate(slots) if s < 0]
        assert got[base].abs().max() == 0


def test_npu_cleared_slot_and_step_without_adapters(npu):
    ab = _adapters(8, torch.float16)
    layer = _layer(None, torch.float16, 8, ab)
    x = torch.randn(len(DECODE), IN)
    layer.clear_slot(2)
    got = _delta(layer, DECODE, x, split=False)
    assert got[[0, 6]].abs().max() == 0
    torch.testing.assert_close(got.float(), _reference(DECODE, x, 8, {k: v for k, v in ab.items() if k[0] != 2}),
                               **TOL[torch.float16])
    layer.step.begin(None, {"npu"}, 8, torch.float16, CPU)
    out = torch.zeros(3, sum(SHARDS), dtype=torch.float16)
    layer.add_(x[:3].half(), out)
    assert out.abs().max() == 0


def test_npu_path_only_where_the_contract_fits(npu, monkeypatch):
    assert choose_kind(CPU, torch.float16, 8, IN, SHARDS) == "npu"
    assert choose_kind(CPU, torch.float32, 8, IN, SHARDS) == "masked"     # "only support half and bf16"
    assert choose_kind(CPU, torch.float16, 4, IN, SHARDS) == "masked"     # the expand computes 8/16/32/64
    assert choose_kind(CPU, torch.float16, 64, 64, SHARDS) == "masked"    # shrink: hidden in > rank
    assert choose_kind(CPU, torch.float16, 32, IN, [48, 16]) == "masked"  # expand: rank <= every output slice
    monkeypatch.setattr(npu._emulator, "device_name", "Ascend310P3 (emulated)")
    assert choose_kind(CPU, torch.float16, 8, IN, SHARDS) == "masked"     # vLLM-Ascend uses torch ops on 310P
    monkeypatch.undo()
    monkeypatch.setattr(npu_ops, "ascend_ops", lambda: None)              # vLLM-Ascend's op library missing
    assert choose_kind(CPU, torch.float16, 8, IN, SHARDS) == "masked"


def test_no_npu_path_without_the_emulator():
    assert choose_kind(CPU, torch.float16, 8, IN, SHARDS) == "masked"
    assert npu_ops.ascend_ops() is None


def test_ascend_ops_emulator_follows_the_kernels(npu):
    """The emulated ops against a plain reference of csrc/kernels: the shrink writes scale * x @ W^T as float32
    for tokens with a slot and leaves the others' rows; the expand adds into one slice; sgmv's tokens past the
    segments count as -1; the TORCH_CHECKs and the kernels' dtype / rank needs raise."""
    ops = npu_ops.ascend_ops()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=g).half()
    a = torch.randn(3, 8, 32, generator=g).half()
    b = torch.randn(3, 16, 8, generator=g).half()
    idx = torch.tensor([1, -1, 0, 2, 1])
    y = torch.full((5, 8), 7.0)
    ops.bgmv_shrink(x, a, idx, y, 0.5)
    for t, i in enumerate(idx.tolist()):
        want = torch.full((8,), 7.0) if i < 0 else 0.5 * a[i].float() @ x[t].float()
        torch.testing.assert_close(y[t], want)
    out = torch.ones(5, 40, dtype=torch.float16)
    assert ops.bgmv_expand(y, b, idx, out, 20, 16) is out
    for t, i in enumerate(idx.tolist()):
        want = torch.ones(40)
        if i >= 0:
            want[20:36] += b[i].float() @ y[t]
        torch.testing.assert_close(out[t].float(), want, atol=1e-2, rtol=1e-3)
    y2 = torch.zeros(5, 8)
    ops.sgmv_shrink(x, a, torch.tensor([2, -1]), torch.tensor([2, 1]), y2, 1.0)   # tokens 3, 4: past the segments
    torch.testing.assert_close(y2[:2], (x[:2].float() @ a[2].float().t()))
    assert y2[2:].abs().max() == 0
    with pytest.raises(RuntimeError, match="only support half and bf16"):
        ops.bgmv_shrink(x.float(), a.float(), idx, y, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.bgmv_shrink(x, a, idx, y.half(), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.bgmv_shrink(x, a, idx.int(), y, 1.0)
    with pytest.raises(RuntimeError, match="hidden in should be greater than hidden out"):
        ops.bgmv_shrink(x[:, :8].contiguous(), a[:, :, :8].contiguous(), idx, y, 1.0)
    with pytest.raises(RuntimeError, match="slice_size \\+ slice_offset"):
        ops.bgmv_expand(y, b, idx, out, 30, 16)
    with pytest.raises(RuntimeError, match="rank 4"):
        ops.bgmv_expand(y[:, :4].contiguous(), b[:, :, :4].contiguous(), idx, out, 0, 16)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.bgmv_expand(y, b, idx, out[:, ::2], 0, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.bgmv_shrink(x, a, torch.tensor([0, 0, 0, 0, 3]), y, 1.0)


def test_ascend_ops_leave_with_the_emulator():
    with emulated_torch_npu(npu_on_cpu=True):
        assert npu_ops.ascend_ops() is not None
    with pytest.raises((AttributeError, RuntimeError)):
        torch.ops._C_ascend.bgmv_shrink   # noqa: B018
    with emulated_torch_npu(npu_on_cpu=True):   # registered again by the next emulator
        assert npu_ops.ascend_ops() is not None


# ---- CUDA: FlashInfer's segment GEMM ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rank", [(torch.float16, 8), (torch.bfloat16, 16), (torch.float16, 4)])
@pytest.mark.parametrize("split", [False, True])
def test_segment_gemm_delta_equals_masked(dtype, rank, split):
    ab = _adapters(rank, dtype)
    x = torch.randn(len(PREFILL), IN, generator=torch.Generator().manual_seed(1))
    with emulated_flashinfer() as flashinfer:
        layer = _layer("segment", dtype, rank, ab)
        for slots in (DECODE, PREFILL):
            flashinfer._emulator.calls.clear()
            got = _delta(layer, slots, x[:len(slots)], split)
            torch.testing.assert_close(got.float(), _reference(slots, x[:len(slots)], rank, ab), **TOL[dtype])
            assert flashinfer._emulator.calls["SegmentGEMMWrapper.run"] == 1 + len(SHARDS)
            assert got[[t for t, s in enumerate(slots) if s < 0]].abs().max() == 0
        seg = layer.step.segments   # PREFILL: slots 0, 1, 2, 3 in order, slot 0's two runs gathered together
        assert seg is not None and seg.weight_indices.tolist() == [0, 1, 2, 3]
        assert seg.seg_indptr.tolist() == [0, 7, 13, 17, 18]


def test_segment_gemm_emulator_follows_the_docs():
    """The docstring example of SegmentGEMMWrapper.run (flashinfer/gemm/gemm_base.py), with and without
    weight_indices, row-major weights, and the documented errors."""
    with emulated_flashinfer() as flashinfer:
        gemm = flashinfer.SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8))
        seq_lens = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
        x = torch.randn(10, 128).half()
        weights = torch.randn(4, 256, 128).half()
        y = gemm.run(x, weights, 4, True, seg_lens=seq_lens)
        bounds = [(0, 1), (1, 3), (3, 6), (6, 10)]
        for i, (lo, hi) in enumerate(bounds):
            torch.testing.assert_close(y[lo:hi].float(), x[lo:hi].float() @ weights[i].float().t(), atol=0.1,
                                       rtol=1e-2)
        y = gemm.run(x, weights, 4, True, seg_lens=seq_lens, weight_indices=torch.tensor([0, 1, 0, 1]))
        torch.testing.assert_close(y[3:6].float(), x[3:6].float() @ weights[0].float().t(), atol=0.1, rtol=1e-2)
        y = gemm.forward(x, weights.transpose(1, 2).contiguous(), 2, False, seg_indptr=torch.tensor([0, 1, 3]))
        torch.testing.assert_close(y[1:3].float(), x[1:3].float() @ weights[1].float().t(), atol=0.1, rtol=1e-2)
        assert y[3:].abs().max() == 0   # rows past the segments are not written
        with pytest.raises(ValueError, match="Either seg_lens or seg_indptr"):
            gemm.run(x, weights, 4, True)
        with pytest.raises(ValueError, match="Output tensor shape mismatch"):
            gemm.run(x, weights, 4, True, out=torch.zeros(10, 128).half(), seg_lens=seq_lens)
        with pytest.raises(ValueError, match="dtype"):
            gemm.run(x.float(), weights.float(), 4, True, seg_lens=seq_lens)
        with pytest.raises(ValueError, match="out of range"):
            gemm.run(x, weights, 4, True, seg_lens=seq_lens, weight_indices=torch.tensor([0, 1, 4, 1]))


def test_segment_path_falls_back_without_flashinfer(monkeypatch):
    from pdcluster.engine.lora import cuda_ops

    monkeypatch.setitem(sys.modules, "flashinfer", None)   # `import flashinfer` fails
    assert cuda_ops.segment_gemm(CPU) is None
    assert choose_kind(torch.device("cuda", 0), torch.float16, 8, IN, SHARDS) == "masked"


# ---- an engine with adapters on the emulated NPU ------------------------------------------------------------

NPU_ENGINE = dict(device="npu", dtype="float16", num_gpu_blocks_override=48, max_num_batched_tokens=128,
                  enable_lora=True, max_loras=3, max_lora_rank=8)
ADAPTERS = [("all8", 8, 16, ALL_TARGETS), ("qv4", 4, 32, ["q_proj", "v_proj"]),
            ("mlp2", 2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"])]


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora_npu")
    base = make_tiny_model(str(root / "base"), "llama")
    paths = {name: make_adapter(base, str(root / name), r, alpha, targets, seed=i + 1)
             for i, (name, r, alpha, targets) in enumerate(ADAPTERS)}
    return base, paths


def _generate(engine, paths: dict[str, str]) -> list[list[int]]:
    """Four prompts (one chunked over two steps) under each adapter and the base model, all in flight at once."""
    loras = [LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), start=1)] + [None]
    prompts = make_prompts([21, 5, 40, 150], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    n = 0
    for p in prompts:
        for lora in loras:
            engine.add_request(f"r{n}", p, greedy, lora=lora)
            n += 1
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return [outs[f"r{i}"] for i in range(n)]


@pytest.mark.slow
def test_npu_engine_with_adapters_matches_masked_and_cpu(lora_model, make_engine, monkeypatch):
    """The engine on the emulated NPU computing the deltas with bgmv/sgmv gives the greedy tokens of the same
    engine computing them with the masked path, and of a float16 CPU engine."""
    base, paths = lora_model
    with emulated_torch_npu(npu_on_cpu=True) as torch_npu:
        engine = make_engine(base, **NPU_ENGINE)
        kinds = engine.runner.lora.kinds
        assert kinds == {"npu"}, kinds
        got = _generate(engine, paths)
        calls = torch_npu._emulator.calls
        assert calls["sgmv_shrink"] and calls["bgmv_shrink"], calls   # prefill steps and decode steps
        with monkeypatch.context() as m:
            m.setattr(npu_ops, "ascend_ops", lambda: None)
            masked = make_engine(base, **NPU_ENGINE)
            assert masked.runner.lora.kinds == {"masked"}
            assert _generate(masked, paths) == got
    cpu = make_engine(base, **{**NPU_ENGINE, "device": "cpu"})
    assert _generate(cpu, paths) == got
    assert len({tuple(t) for t in got[:4]}) > 1   # the adapters change the output
