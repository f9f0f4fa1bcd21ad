"""MoE on devices: the torch_npu MoE operators of the emulator against the equivalent-logic code of their documents
(torch_npu-npu_moe_gating_top_k.md, -npu_moe_init_routing_v2.md, -npu_moe_finalize_routing.md, ported below in
numpy as written there) and their documented restrictions; the NPU kernel (engine/layers/moe_npu.py) and the CUDA
kernel (engine/layers/moe_cuda.py, FlashInfer's cutlass_fused_moe under tests/fake_flashinfer) against the CPU kernel
(moe_cpu.py) on random routings with experts that get no token, group-limited sigmoid routing and expert-parallel
ranges; and a tiny Qwen3-MoE engine on the emulated NPU token for token with the same engine on the CPU kernel.
"""

from __future__ import annotations

import numpy as np
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


# ------------------------------------------------------------------ the documents' equivalent logic (numpy)


def doc_gating_top_k(x, k, bias, k_group, group_count, group_select_mode, norm_type, routed_scaling_factor,
                     eps=1e-20):
    """moe_gating_top_k_numpy of torch_npu-npu_moe_gating_top_k.md (group_count 1 skips the grouping)."""
    x = x.astype(np.float32)
    if norm_type == 0:
        x = np.exp(x - np.expand_dims(np.log(np.sum(np.exp(x), axis=-1)), axis=-1))
    else:
        x = 1 / (1 + np.exp(-x))
    original_x = x
    if bias is not None:
        x = x + bias
    if group_count > 1:
        x = x.reshape(x.shape[0], group_count, -1)
        if group_select_mode == 0:
            group_x = np.amax(x, axis=-1)
        else:
            group_x = np.partition(x, -2, axis=-1)[..., -2:].sum(axis=-1)
        indices = np.argsort(-group_x, axis=-1, kind="stable")[:, :k_group]
        mask = np.ones((x.shape[0], group_count), dtype=bool)
        mask[np.arange(x.shape[0])[:, None], indices] = False
        x = np.where(mask[..., None], float("-inf"), x).reshape(x.shape[0], -1)
    indices = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    y = np.take_along_axis(original_x, indices, axis=1)
    if norm_type == 1:
        y /= np.sum(y, axis=-1, keepdims=True) + eps
    return y * routed_scaling_factor, indices.astype(np.int32), original_x


def doc_init_routing_v2(x, expert_idx, expert_range, row_idx_type, expert_tokens_num_type):
    """MoeInitRoutingV2CPU.cpu_op_exec of torch_npu-npu_moe_init_routing_v2.md, dropless and unquantized."""
    expert_start, expert_end = expert_range
    num_rows, k = x.shape[0], expert_idx.shape[-1]
    expert_idx_in = expert_idx.copy().reshape(-1)
    actual = int(np.sum((expert_idx >= expert_start) & (expert_idx < expert_end)))
    expert_idx_in[expert_idx_in < expert_start] = np.int32(np.iinfo(np.int32).max)
    order = np.argsort(expert_idx_in, axis=-1, kind="stable")
    sorted_ids = expert_idx_in[order]
    if row_idx_type == 1:
        expanded_row_idx = order.astype(np.int32)
    else:
        expanded_row_idx = np.ones(num_rows * k).astype(np.int32) * -1
        expanded_row_idx[order[:actual]] = np.arange(actual)
    counts = np.bincount(sorted_ids[:actual] - expert_start)
    counts = np.concatenate([counts, np.zeros(expert_end - expert_start - len(counts)).astype(np.int64)])
    if expert_tokens_num_type == 0:
        counts = np.cumsum(counts)
    return x[order[:actual] // k, :], expanded_row_idx, counts.astype(np.int64), actual


def doc_finalize_routing(rows, skip1, scales, src_to_dst, expert_for_source_row, bias, drop_pad_mode):
    """moe_finalize_routing_np of torch_npu-npu_moe_finalize_routing.md; drop_pad_mode 2 reads the index row-major
    (i * K + k) where the document's loop, written for mode 0, reads it column-major (k * NUM_ROWS + i)."""
    k = scales.shape[1]
    num_rows = src_to_dst.shape[0] // k
    out = skip1.astype(np.float64).copy() if skip1 is not None else np.zeros((num_rows, rows.shape[-1]))
    for i in range(num_rows):
        for j in range(k):
            value = src_to_dst[j * num_rows + i] if drop_pad_mode == 0 else src_to_dst[i * k + j]
            dst_row = 0 if value == -1 else rows[value, :]
            extra = bias[expert_for_source_row[i, j], :] if bias is not None else 0
            out[i, :] += scales[i, j] * (dst_row + extra)
    return out


# ------------------------------------------------------------------------------------- operator tests


@pytest.mark.parametrize("norm_type, groups, k_group, mode, with_bias, scale", [
    (0, 1, 1, 0, False, 1.0),     # Qwen3-MoE / Mixtral: softmax top-k
    (1, 4, 2, 1, True, 2.5),      # DeepSeek-V3 noaux_tc: sigmoid, bias, top-2-sum groups, scaling
    (0, 4, 3, 0, False, 1.0),     # DeepSeek-V2: softmax, groups by their max
])
def test_gating_top_k_matches_the_documented_logic(npu, norm_type, groups, k_group, mode, with_bias, scale):
    g = torch.Generator().manual_seed(norm_type * 10 + groups)
    x = torch.randn(37, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.1 if with_bias else None
    y, idx, norm = npu.npu_moe_gating_top_k(x, 6, bias=bias, k_group=k_group, group_count=groups,
                                            group_select_mode=mode, norm_type=norm_type, out_flag=True,
                                            routed_scaling_factor=scale)
    want_y, want_idx, want_norm = doc_gating_top_k(x.numpy(), 6, None if bias is None else bias.numpy(), k_group,
                                                   groups, mode, norm_type, scale)
    assert idx.dtype == torch.int32 and y.dtype == x.dtype and norm.dtype == torch.float32
    np.testing.assert_array_equal(idx.numpy(), want_idx)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.numpy(), want_norm, rtol=1e-5, atol=1e-7)


def test_gating_top_k_restrictions(npu):
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="renorm"):
        npu.npu_moe_gating_top_k(x, 2, renorm=1)
    with pytest.raises(RuntimeError, match="more than 2"):
        npu.npu_moe_gating_top_k(x, 2, k_group=1, group_count=8)   # 2 experts a group
    with pytest.raises(RuntimeError, match="k must lie"):
        npu.npu_moe_gating_top_k(x, 5, k_group=1, group_count=4)   # the kept group holds 4
    with pytest.raises(RuntimeError, match="dtype of x and bias"):
        npu.npu_moe_gating_top_k(x, 2, bias=torch.zeros(16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="2048"):
        npu.npu_moe_gating_top_k(torch.randn(1, 4096), 2)
    _, _, norm = npu.npu_moe_gating_top_k(x, 2)
    assert torch.isnan(norm).all()   # not written without out_flag


@pytest.mark.parametrize("expert_range, row_idx_type, count_type", [
    ((0, 8), 0, 1), ((2, 5), 0, 1), ((4, 8), 1, 0), ((0, 3), 1, 1)])
def test_init_routing_v2_matches_the_documented_logic(npu, expert_range, row_idx_type, count_type):
    g = torch.Generator().manual_seed(sum(expert_range))
    x = torch.randn(11, 16, generator=g)
    ids = torch.randint(0, 7, (11, 3), generator=g, dtype=torch.int32)   # expert 7 gets no token
    out_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, ids, active_num=33, expert_num=8, expert_tokens_num_type=count_type, expert_tokens_num_flag=True,
        active_expert_range=list(expert_range), row_idx_type=row_idx_type)
    want_x, want_idx, want_counts, available = doc_init_routing_v2(x.numpy(), ids.numpy(), expert_range,
                                                                   row_idx_type, count_type)
    assert out_x.shape == (33, 16) and row_idx.dtype == torch.int32 and counts.dtype == torch.int64
    np.testing.assert_array_equal(out_x[:available].numpy(), want_x)
    assert torch.isnan(out_x[available:]).all()
    valid = slice(None) if row_idx_type == 0 else slice(0, available)   # scatter: the rest is uninitialized
    np.testing.assert_array_equal(row_idx[valid].numpy(), want_idx[valid])
    np.testing.assert_array_equal(counts.numpy(), want_counts)


def test_init_routing_v2_restrictions(npu):
    x, ids = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_moe_init_routing_v2(x, ids.long(), expert_num=4)
    with pytest.raises(RuntimeError, match="expert ids must lie"):
        npu.npu_moe_init_routing_v2(x, ids + 4, expert_num=4)
    with pytest.raises(RuntimeError, match="active_expert_range"):
        npu.npu_moe_init_routing_v2(x, ids, expert_num=4, active_expert_range=[2, 6])
    with pytest.raises(NotImplementedError):
        npu.npu_moe_init_routing_v2(x, ids, expert_num=4, quant_mode=1)


@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_matches_the_documented_logic(npu, mode):
    g = torch.Generator().manual_seed(mode)
    rows, k, e, h = 9, 3, 5, 8
    permuted = torch.randn(rows * k, h, generator=g)
    skip1, scales = torch.randn(rows, h, generator=g), torch.rand(rows, k, generator=g)
    bias = torch.randn(e, h, generator=g)
    src = torch.randperm(rows * k, generator=g).to(torch.int32)
    src[[1, 7]] = -1   # pairs routed to another rank
    experts = torch.randint(0, e, (rows, k), generator=g, dtype=torch.int32)
    out = npu.npu_moe_finalize_routing(permuted, skip1, None, bias, scales, src, experts, drop_pad_mode=mode)
    want = doc_finalize_routing(permuted.numpy(), skip1.numpy(), scales.numpy(), src.numpy(), experts.numpy(),
                                bias.numpy(), mode)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        npu.npu_moe_finalize_routing(permuted, None, None, None, scales.half(), src, experts, drop_pad_mode=mode)


def test_grouped_matmul_groups_and_restrictions(npu):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(10, 6, generator=g), torch.randn(3, 8, 6, generator=g)   # [E, N, K]: passed transposed
    counts = torch.tensor([4, 0, 5], dtype=torch.int64)   # 9 of 10 rows: the last one is not written
    y = npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts, split_item=2, group_type=0,
                               group_list_type=1)[0]
    want = torch.cat([x[:4] @ w[0].t(), x[4:9] @ w[2].t()])
    torch.testing.assert_close(y[:9], want)
    assert torch.isnan(y[9]).all()
    cumsum = npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts.cumsum(0), split_item=2,
                                    group_type=0, group_list_type=0)[0]
    torch.testing.assert_close(cumsum[:9], want)
    with pytest.raises(RuntimeError, match="length must not be 1"):
        npu.npu_grouped_matmul([x], [w[:1].transpose(1, 2)], group_list=counts[:1], split_item=2, group_type=0,
                               group_list_type=1)
    with pytest.raises(RuntimeError, match="cover"):
        npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts * 2, split_item=2, group_type=0,
                               group_list_type=1)
    with pytest.raises(RuntimeError, match="x不支持转置"):
        npu.npu_grouped_matmul([x.t().contiguous().t()], [w.transpose(1, 2)], group_list=counts, split_item=2,
                               group_type=0, group_list_type=1)
    with pytest.raises(RuntimeError, match="split_item"):
        npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts, split_item=0, group_type=0,
                               group_list_type=1)


# --------------------------------------------------------------------------------- kernels vs the CPU kernel


def random_experts(num_local: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    return w13, w2


def random_routing(tokens: int, num_experts: int, top_k: int, used: int, seed: int):
    """Distinct experts per token drawn from the first `used` experts only (the rest get no token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(used, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=g)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (id, weight) pairs sorted by id: routings compare whatever order top-k returned them in."""
    order = ids.long().argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


ROUTINGS = {
    "qwen3_moe": dict(num_experts=16, top_k=4),
    "mixtral": dict(num_experts=8, top_k=2, renormalize=True),
    "deepseek_v3": dict(num_experts=32, top_k=6, scoring="sigmoid", num_groups=4, topk_groups=2, scaling_factor=2.5),
    "deepseek_v2": dict(num_experts=32, top_k=6, num_groups=4, topk_groups=3, renormalize=False, group_score="max",
                        scaling_factor=1.5),
    "sigmoid_no_renorm": dict(num_experts=16, top_k=2, scoring="sigmoid", renormalize=False),   # torch fallback
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_npu_select_matches_the_cpu_routing(npu, name):
    from pdcluster.engine.layers.moe_cpu import CpuMoEKernel
    from pdcluster.engine.layers.moe_npu import NpuMoEKernel
    from pdcluster.engine.layers.moe_routing import RoutingConfig

    cfg = RoutingConfig(**ROUTINGS[name])
    g = torch.Generator().manual_seed(len(name))
    logits = torch.randn(29, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05 if cfg.scoring == "sigmoid" else None
    got = by_expert(*NpuMoEKernel().select(logits, cfg, bias))
    want = by_expert(*CpuMoEKernel().select(logits, cfg, bias))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[1].dtype == torch.float32 and got[0].dtype == torch.int32
    assert bool(npu._emulator.calls["npu_moe_gating_top_k"]) == (name != "sigmoid_no_renorm")


KERNEL_CASES = [   # (num_experts, expert ranges of the ranks, top_k, experts that get tokens)
    (8, [(0, 8)], 2, 6),                      # one rank, experts 6 and 7 idle
    (8, [(0, 4), (4, 8)], 2, 7),              # expert parallelism over 2 ranks
    (8, [(0, 4), (4, 8)], 3, 4),              # ... the second of which receives no token at all
    (4, [(0, 1), (1, 2), (2, 3), (3, 4)], 2, 4),   # one expert a rank (cumsum group lists)
]


def assert_kernel_matches_cpu(kernel, dtype: torch.dtype, num_experts: int, ranges, top_k: int, used: int,
                              tol: float) -> None:
    """Each rank's part against the CPU kernel's, and the ranks' sum against the whole layer on one rank."""
    from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

    cpu = CpuMoEKernel()
    hidden_size, inter = 64, 32
    w13, w2 = random_experts(num_experts, hidden_size, inter, dtype, seed=num_experts)
    weights, ids = random_routing(23, num_experts, top_k, used, seed=len(ranges))
    hidden = torch.randn(23, hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    total = torch.zeros(23, hidden_size)
    for start, end in ranges:
        args = (hidden, w13[start:end].contiguous(), w2[start:end].contiguous(), weights, ids, start, num_experts)
        got = kernel.experts(*args)
        assert got.dtype == dtype and got.shape == hidden.shape
        torch.testing.assert_close(got.float(), cpu.experts(*args).float(), rtol=tol, atol=tol)
        total += got.float()
    whole = cpu.experts(hidden, w13, w2, weights, ids, 0, num_experts).float()
    torch.testing.assert_close(total, whole, rtol=tol, atol=tol * len(ranges))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_experts, ranges, top_k, used", KERNEL_CASES)
def test_npu_kernel_matches_the_cpu_kernel(npu, dtype, tol, num_experts, ranges, top_k, used):
    from pdcluster.engine.layers.moe_npu import NpuMoEKernel

    assert_kernel_matches_cpu(NpuMoEKernel(), dtype, num_experts, ranges, top_k, used, tol)
    for op in ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing"):
        assert npu._emulator.calls[op], op


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_experts, ranges, top_k, used", KERNEL_CASES)
def test_cuda_kernel_matches_the_cpu_kernel(dtype, tol, num_experts, ranges, top_k, used):
    with emulated_flashinfer(float32=dtype == torch.float32) as fi:
        from pdcluster.engine.layers.moe_cuda import CudaMoEKernel

        assert_kernel_matches_cpu(CudaMoEKernel(), dtype, num_experts, ranges, top_k, used, tol)
        assert fi._emulator.calls["cutlass_fused_moe"] == len(ranges)


def test_cuda_kernel_prepacks_w31_and_falls_back():
    """prepack swaps gate and up once (the kernel's fc1 is up first) and keeps the only copies FusedMoE holds after
    it; float32 without the emulator switch, and sizes the kernel's alignment refuses, run the CPU kernel's path."""
    from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

    w13, w2 = random_experts(4, 64, 32, torch.bfloat16, seed=1)
    weights, ids = random_routing(5, 4, 2, 4, seed=2)
    hidden = torch.randn(5, 64).bfloat16()
    with emulated_flashinfer() as fi:
        from pdcluster.engine.layers.moe_cuda import CudaMoEKernel

        kernel = CudaMoEKernel()
        packed = kernel.prepack(w13, w2)
        assert torch.equal(packed[0][:, :32], w13[:, 32:]) and torch.equal(packed[0][:, 32:], w13[:, :32])
        released = torch.empty(0, dtype=torch.bfloat16)
        torch.testing.assert_close(kernel.experts(hidden, released, released, weights, ids, 0, 4, packed=packed),
                                   kernel.experts(hidden, w13, w2, weights, ids, 0, 4))
        assert fi._emulator.calls["cutlass_fused_moe"] == 2
        for w13_, w2_, x in ((w13.float(), w2.float(), hidden.float()),   # float32: no runner
                             (w13[:, :, :60], w2[:, :60], hidden[:, :60])):   # hidden 60: not 8-aligned
            assert kernel.prepack(w13_, w2_) is None
            torch.testing.assert_close(kernel.experts(x, w13_, w2_, weights, ids, 0, 4),
                                       CpuMoEKernel().experts(x, w13_, w2_, weights, ids, 0, 4))
        assert fi._emulator.calls["cutlass_fused_moe"] == 2


# --------------------------------------------------------------------------------------- whole engines


PROMPTS = make_prompts([5, 40, 130, 1], seed=1)   # a full 128-token block, a chunked prompt (128-token budget)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe")


def with_moe_kernel(monkeypatch, make, kernel_cls):
    """An engine made while FusedMoE picks `kernel_cls` whatever the device (it picks at load, in prepack)."""
    from pdcluster.engine.layers import moe

    with monkeypatch.context() as m:
        m.setattr(moe, "kernel_for", lambda device: kernel_cls())
        return make()


def test_qwen3_moe_on_npu_is_token_exact_with_the_cpu_moe_kernel(tiny_qwen3_moe, make_engine, monkeypatch):
    """float16 (the fused attention takes no float32): every NPU path, the MoE operators included, against the same
    engine on the CPU MoE kernel. (With the cpu attention backend as well, a near-tied float16 logit of this random
    model flips one late token: the fused attention's and the MoE operators' single roundings add up.)"""
    from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

    kw = dict(device="npu", dtype="float16", num_gpu_blocks_override=32, max_num_batched_tokens=128)
    with emulated_torch_npu(npu_on_cpu=True) as npu:
        engine = make_engine(tiny_qwen3_moe, **kw)
        got = run_all(engine, PROMPTS, GREEDY)
        for op in ("npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul",
                   "npu_moe_finalize_routing"):
            assert npu._emulator.calls[op], op
        reference = with_moe_kernel(monkeypatch, lambda: make_engine(tiny_qwen3_moe, **kw), CpuMoEKernel)
        assert run_all(reference, PROMPTS, GREEDY) == got


def test_qwen3_moe_with_the_cuda_kernel_is_token_exact(tiny_qwen3_moe, make_engine, monkeypatch):
    """float32 through the emulator's switch: the FlashInfer attention and cutlass_fused_moe against a CPU engine."""
    from pdcluster.engine.layers.moe_cuda import CudaMoEKernel

    with emulated_flashinfer(float32=True) as fi:
        engine = with_moe_kernel(monkeypatch, lambda: make_engine(tiny_qwen3_moe, attention_backend="flashinfer"),
                                 CudaMoEKernel)
        got = run_all(engine, PROMPTS, GREEDY)
        assert fi._emulator.calls["cutlass_fused_moe"]
    assert run_all(make_engine(tiny_qwen3_moe), PROMPTS, GREEDY) == got
