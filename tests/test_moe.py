"""Mixture of experts: `select_experts` against transformers' own routers (Qwen3-MoE softmax with and without
norm_topk_prob, Mixtral, DeepSeek-V3 sigmoid + correction bias + group-limited top-k + scaling, DeepSeek-V2
group-limited greedy), tied router logits included; the CPU kernel and FusedMoE against a per-token loop (experts
that get no token, one token, expert-parallel and tensor-parallel slices); both checkpoint layouts of the experts."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdcluster.engine.convert import convert_model
from pdcluster.engine.layers.moe import FusedMoE
from pdcluster.engine.layers.moe_cpu import CpuMoEKernel
from pdcluster.engine.layers.moe_routing import RoutingConfig, select_experts
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.testing import make_tiny_model, prefill_logits

HIDDEN = 32


def _router_input(num_experts: int, tokens: int = 64, tied: bool = False, seed: int = 0):
    """Hidden states and a router weight; `tied`: experts 1, 5 and 6 share one weight row (and 2 copies 3), so
    their logits, and scores, are exactly equal for every token."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    weight = torch.randn(num_experts, HIDDEN, generator=g)
    if tied:
        weight[5] = weight[1]
        weight[6] = weight[1]
        weight[2] = weight[3]
    return hidden, weight


def _same_choice(ids: torch.Tensor, weights: torch.Tensor, want_ids: torch.Tensor, want_weights: torch.Tensor):
    """Same experts per token (order free: the routers' top-k may be unsorted) with the same weights."""
    order, want_order = ids.long().argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.long().gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.float().gather(1, want_order),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_routing_matches_qwen3_moe_router(norm, tied):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    hidden, weight = _router_input(16, tied=tied)
    router = Qwen3MoeTopKRouter(config)
    router.weight.data.copy_(weight)
    with torch.no_grad():
        logits, want_weights, want_ids = router(hidden)
    weights, ids = select_experts(logits, RoutingConfig(16, 4, renormalize=norm))
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)   # both sorted by score: the same order too
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_ties_pick_the_experts_torch_topk_picks():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    hidden, weight = _router_input(8, tied=True)
    weight[:] = weight[1]   # every logit of a token equal: the pick is decided by the tie-break alone
    router = MixtralTopKRouter(config)
    router.weight.data.copy_(weight)
    with torch.no_grad():
        logits, want_weights, want_ids = router(hidden)
    weights, ids = select_experts(logits, RoutingConfig(8, 2))
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("groups,topk_groups,norm", [(4, 2, True), (1, 1, True), (8, 3, False)])
def test_sigmoid_grouped_routing_matches_deepseek_v3_router(groups, topk_groups, norm, tied):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    experts = 32
    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=6, n_group=groups,
                              topk_group=topk_groups, norm_topk_prob=norm, routed_scaling_factor=2.5)
    hidden, weight = _router_input(experts, tied=tied, seed=1)
    router = DeepseekV3TopkRouter(config)
    router.weight.data.copy_(weight)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(2)) * 0.3
    if tied:
        bias[5] = bias[1]
        bias[6] = bias[1]
        bias[2] = bias[3]
    router.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        logits, want_weights, want_ids = router(hidden)
    cfg = RoutingConfig(experts, 6, scoring="sigmoid", renormalize=norm, num_groups=groups, topk_groups=topk_groups,
                        scaling_factor=2.5)
    weights, ids = select_experts(logits, cfg, bias)
    _same_choice(ids, weights, want_ids, want_weights)
    # the bias changed the choice for some tokens, yet the weights are the unbiased scores
    plain_ids = select_experts(logits, cfg, None)[1]
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)


def test_group_limited_greedy_matches_deepseek_v2_router():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                              topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    hidden, weight = _router_input(16, seed=3)
    router = DeepseekV2TopkRouter(config)
    router.weight.data.copy_(weight)
    with torch.no_grad():
        logits, want_weights, want_ids = router(hidden)
    cfg = RoutingConfig(16, 3, renormalize=False, num_groups=4, topk_groups=2, scaling_factor=1.5, group_score="max")
    weights, ids = select_experts(logits, cfg)
    _same_choice(ids, weights, want_ids, want_weights)


def test_routing_config_refuses_impossible_shapes():
    with pytest.raises(ValueError):
        RoutingConfig(8, 9)
    with pytest.raises(ValueError):
        RoutingConfig(10, 2, num_groups=4)
    with pytest.raises(ValueError):
        RoutingConfig(8, 2, scoring="relu")


# ------------------------------------------------------------------ the experts


def _per_token_reference(hidden, w13, w2, weights, ids, expert_start=0):
    """Each token, each of its experts, one at a time."""
    n = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - expert_start
            if not 0 <= e < w13.shape[0]:
                continue
            x = hidden[t].double()
            act = F.silu(w13[e, :n].double() @ x) * (w13[e, n:].double() @ x)
            out[t] += float(weights[t, slot]) * (w2[e].double() @ act)
    return out


def _random_experts(experts: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, HIDDEN, generator=g) * 0.2,
            torch.randn(experts, HIDDEN, inter, generator=g) * 0.2)


@pytest.mark.parametrize("tokens", [1, 3, 50])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_kernel_matches_per_token_loop(tokens, packed):
    experts, top_k = 16, 2
    w13, w2 = _random_experts(experts, 24)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(5))
    logits[:, 7] = -1e9   # expert 7 never chosen; with 1 or 3 tokens most experts get none
    weights, ids = select_experts(logits, RoutingConfig(experts, top_k))
    kernel = CpuMoEKernel()
    extra = {"packed": kernel.prepack(w13, w2)} if packed else {}
    got = kernel.experts(hidden, w13, w2, weights, ids, 0, experts, **extra)
    torch.testing.assert_close(got.double(), _per_token_reference(hidden, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-5)


def test_cpu_kernel_expert_ranges_add_up_to_all_experts():
    """Expert parallelism: each rank's range gives only its experts' part, the parts sum to the whole."""
    experts, tokens = 8, 20
    w13, w2 = _random_experts(experts, 16, seed=1)
    hidden = torch.randn(tokens, HIDDEN)
    weights, ids = select_experts(torch.randn(tokens, experts), RoutingConfig(experts, 3))
    kernel = CpuMoEKernel()
    parts = [kernel.experts(hidden, w13[s:s + 2], w2[s:s + 2], weights, ids, s, experts) for s in range(0, 8, 2)]
    for s, part in zip(range(0, 8, 2), parts, strict=True):
        torch.testing.assert_close(part.double(), _per_token_reference(hidden, w13[s:s + 2], w2[s:s + 2], weights,
                                                                       ids, s), rtol=1e-4, atol=1e-5)
    whole = kernel.experts(hidden, w13, w2, weights, ids, 0, experts)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-4, atol=1e-5)


def _filled_moe(tp: TPGroup, expert_parallel: bool, full_w13, full_w2, gate) -> FusedMoE:
    experts, inter = full_w13.shape[0], full_w13.shape[1] // 2
    moe = FusedMoE(experts, HIDDEN, inter, RoutingConfig(experts, 2), tp, expert_parallel)
    moe.gate.weight.data.copy_(gate)
    for e in range(experts):   # whole checkpoint tensors: load_expert cuts this rank's part
        moe.load_expert("w", e, "gate", full_w13[e, :inter])
        moe.load_expert("w", e, "up", full_w13[e, inter:])
        moe.load_expert("w", e, "down", full_w2[e])
    return moe


@torch.no_grad()
def test_fused_moe_tensor_and_expert_parallel_parts_sum_to_the_whole():
    experts, inter, tokens = 8, 32, 12
    w13, w2 = _random_experts(experts, inter, seed=2)
    gate = torch.randn(experts, HIDDEN)
    hidden = torch.randn(tokens, HIDDEN)
    whole = _filled_moe(TPGroup(), False, w13, w2, gate)
    want = whole(hidden)
    weights, ids = select_experts(hidden @ gate.T, RoutingConfig(experts, 2))
    torch.testing.assert_close(want.double(), _per_token_reference(hidden, w13, w2, weights, ids), rtol=1e-4,
                               atol=1e-5)
    assert torch.equal(whole.expert_counts, torch.bincount(ids.flatten().long(), minlength=experts))
    for expert_parallel in (False, True):
        # TPGroup.all_reduce is the identity for size 1: compute each rank's part, sum here
        ranks = [_filled_moe(TPGroup(rank=r, size=2), expert_parallel, w13, w2, gate) for r in range(2)]
        for moe in ranks:
            moe.tp = TPGroup()
        if expert_parallel:
            assert ranks[1].w13.shape == (experts // 2, 2 * inter, HIDDEN) and ranks[1].expert_start == experts // 2
        else:
            assert ranks[1].w13.shape == (experts, inter, HIDDEN)
        torch.testing.assert_close(ranks[0](hidden) + ranks[1](hidden), want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe")


def test_fused_checkpoint_layout_loads_the_same_weights(tiny_qwen3_moe, tmp_path, make_engine):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) written
    as a checkpoint gives the engine the same model as the per-expert Hub layout."""
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for name in os.listdir(tiny_qwen3_moe):
        if name != "model.safetensors":
            (fused_dir / name).write_bytes(open(os.path.join(tiny_qwen3_moe, name), "rb").read())
    tensors = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors"))
    config = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))
    experts = config.get("num_experts") or config["num_local_experts"]
    prefix = "model.layers.1.mlp.experts"
    gate_up = torch.stack([torch.cat((tensors.pop(f"{prefix}.{e}.gate_proj.weight"),
                                      tensors.pop(f"{prefix}.{e}.up_proj.weight"))) for e in range(experts)])
    down = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(experts)])
    tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = gate_up, down
    save_file(tensors, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = list(range(3, 60))
    a = prefill_logits(make_engine(tiny_qwen3_moe), ids)
    b = prefill_logits(make_engine(str(fused_dir)), ids)
    assert torch.equal(a, b)
    converted = convert_model(str(fused_dir), str(tmp_path / "converted"), dtype="float32")   # per-expert again
    assert f"{prefix}.0.gate_proj.weight" in load_file(os.path.join(converted, "model.safetensors"))
    assert torch.equal(prefill_logits(make_engine(converted), ids), a)
