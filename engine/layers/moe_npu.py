"""The MoE kernel on Ascend NPUs: torch_npu's fused MoE operators, called as vLLM-Ascend's AllGather MoE path calls
them (vllm_ascend/ops/fused_moe: router/fused_topk_router.py, token_dispatcher.py TokenDispatcherWithAllGather,
moe_mlp.py unquant_apply_mlp).

- select: `npu_moe_gating_top_k` (softmax or sigmoid, bias for the choice only, group-limited top-k with groups
  ranked by the sum of their top two (group_select_mode 1, DeepSeek-V3) or their best (0, DeepSeek-V2),
  routed_scaling_factor). The operator renormalizes sigmoid weights itself and never softmax ones, so softmax +
  renormalize divides here (as vLLM-Ascend's DeviceOperator.moe_gating_top_k does), with the scaling factor applied
  after that division. Shapes the operator refuses (more than 2048 experts, groups of 2 or fewer
  experts, k above the experts the kept groups hold) and sigmoid without renormalization go through the torch
  routing instead, as vLLM-Ascend's router factory falls back to its native grouped top-k.
- experts: `npu_moe_init_routing_v2` sorts the (token, k) pairs by expert, keeping those of this rank's experts
  (active_expert_range), with per-expert counts; two `npu_grouped_matmul` calls (count-mode group lists, m-axis
  groups, the [E, 2I, H] / [E, H, I] weights passed as transposed views) around `npu_swiglu`; then
  `npu_moe_finalize_routing` (drop_pad_mode 2: the routing's row-major gather index) sums each token's weighted
  expert rows. vLLM-Ascend's AllGather path combined with this finalize until September 2025, when #2689 replaced
  `npu_moe_init_routing` + `npu_moe_finalize_routing` by `npu_moe_init_routing_v2` + `npu_moe_token_unpermute`
  (for speed; its moe_comm_method.py also notes an accuracy issue of the finalize); the finalize is the operator
  issue #29 names, and it takes the v2 routing's index as it is.

Runs only under the CPU emulator of torch_npu here (tests/fake_torch_npu, tests/test_moe_devices.py).
"""

from __future__ import annotations

import torch

from pdcluster.engine.layers.moe_routing import RoutingConfig, select_experts

MAX_FUSED_EXPERTS = 2048
NORM_SOFTMAX, NORM_SIGMOID = 0, 1
GROUP_SELECT_MODE = {"max": 0, "top2_sum": 1}
COUNT_MODE, CUMSUM_MODE = 1, 0


def fused_gating_supported(cfg: RoutingConfig) -> bool:
    """What npu_moe_gating_top_k accepts (torch_npu-npu_moe_gating_top_k.md) and vLLM-Ascend routes through it."""
    if cfg.scoring not in ("softmax", "sigmoid") or (cfg.scoring == "sigmoid" and not cfg.renormalize):
        return False
    e, groups = cfg.num_experts, cfg.num_groups
    if e > MAX_FUSED_EXPERTS or groups < 1 or e % groups or e // groups <= 2:
        return False
    if -(-(e // groups) // 32) * 32 * groups > MAX_FUSED_EXPERTS:
        return False
    return 1 <= cfg.topk_groups <= groups and 1 <= cfg.top_k <= e // groups * cfg.topk_groups


class NpuMoEKernel:
    def __init__(self) -> None:
        import torch_npu

        self.ops = torch_npu

    def select(self, router_logits: torch.Tensor, cfg: RoutingConfig,
               correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not fused_gating_supported(cfg):
            return select_experts(router_logits, cfg, correction_bias)
        softmax = cfg.scoring == "softmax"
        divide_here = softmax and cfg.renormalize
        bias = None if correction_bias is None else correction_bias.to(router_logits.dtype)
        weights, ids, _ = self.ops.npu_moe_gating_top_k(
            router_logits, k=cfg.top_k, bias=bias, k_group=cfg.topk_groups, group_count=cfg.num_groups,
            group_select_mode=GROUP_SELECT_MODE[cfg.group_score], renorm=0,
            norm_type=NORM_SOFTMAX if softmax else NORM_SIGMOID,
            out_flag=False, routed_scaling_factor=1.0 if divide_here else cfg.scaling_factor, eps=1e-20)
        weights = weights.float()
        if divide_here:
            weights = weights / weights.sum(dim=-1, keepdim=True) * cfg.scaling_factor
        return weights, ids.to(torch.int32)

    def experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, expert_start: int, num_experts: int) -> torch.Tensor:
        """hidden [T, H]; w13 [E_local, 2 * I, H] (gate rows first); w2 [E_local, H, I]; weights / ids [T, k] of
        global experts among `num_experts`; only experts [expert_start, expert_start + E_local) contribute."""
        tokens, top_k = ids.shape
        if tokens == 0:
            return hidden.new_zeros(hidden.shape)
        local = w13.shape[0]
        end = expert_start + local
        expanded, row_idx, counts, _ = self.ops.npu_moe_init_routing_v2(
            hidden.contiguous(), ids.to(torch.int32), active_num=tokens * top_k, expert_num=num_experts,
            expert_tokens_num_type=COUNT_MODE if local > 1 else CUMSUM_MODE, expert_tokens_num_flag=True,
            active_expert_range=[expert_start, end], quant_mode=-1)
        # count-mode group lists may not have length 1 (torch_npu-npu_grouped_matmul.md): one expert uses cumsum
        group = dict(split_item=2, group_type=0, group_list=counts,
                     group_list_type=COUNT_MODE if local > 1 else CUMSUM_MODE)
        gate_up = self.ops.npu_grouped_matmul([expanded], [w13.transpose(1, 2)], **group)[0]
        down = self.ops.npu_grouped_matmul([self.ops.npu_swiglu(gate_up)], [w2.transpose(1, 2)], **group)[0]
        mine = (ids >= expert_start) & (ids < end)   # other ranks' pairs: index -1 in row_idx, weight 0 as well
        scales = (weights * mine).to(down.dtype)
        return self.ops.npu_moe_finalize_routing(down, skip1=None, skip2=None, bias=None, scales=scales,
                                                 expanded_src_to_dst_row=row_idx,
                                                 export_for_source_row=ids.to(torch.int32), drop_pad_mode=2)
