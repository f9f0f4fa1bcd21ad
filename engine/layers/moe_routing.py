"""Mixture-of-experts routing: which experts each token goes to, and with what weights.

One torch implementation of the schemes the supported checkpoints use, written to pick exactly the experts
transformers' own routers pick (same score tensor given to the same `torch.topk` call, so tied scores resolve the
same way):
- softmax top-k, optionally renormalized over the chosen k (Qwen3-MoE `norm_topk_prob`, Mixtral always);
- sigmoid scores, `e_score_correction_bias` added for the choice only, group-limited top-k (the `topk_groups` groups
  with the best sum of their top two biased scores), renormalized, times `routed_scaling_factor` (DeepSeek-V3
  "noaux_tc");
- softmax with group-limited top-k by each group's best score (DeepSeek-V2 "group_limited_greedy",
  `group_score="max"`).
Device kernels (moe_npu.py, moe_cuda.py) call their fused routing operators where those match and fall back here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"        # "softmax" | "sigmoid" (DeepSeek-V3 noaux_tc)
    renormalize: bool = True        # norm_topk_prob
    num_groups: int = 1             # n_group  (group-limited top-k when > 1)
    topk_groups: int = 1            # topk_group
    scaling_factor: float = 1.0     # routed_scaling_factor
    group_score: str = "top2_sum"   # how a group is ranked: "top2_sum" (DeepSeek-V3) | "max" (DeepSeek-V2)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown MoE scoring function {self.scoring!r}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"unknown MoE group score {self.group_score!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_groups < 1 or self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts cannot form {self.num_groups} groups of which "
                             f"{self.topk_groups} are kept")


def _group_mask(scores: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_groups` best groups."""
    grouped = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
    if cfg.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, cfg.num_experts).bool()


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int32). The correction bias changes only
    which experts are chosen; the weights are the unbiased scores."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    if cfg.num_groups == 1 and correction_bias is None and cfg.scoring == "softmax":
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1)   # Qwen-MoE / Mixtral: sorted top-k of the probs
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if cfg.num_groups > 1:
            choice = choice.masked_fill(~_group_mask(choice, cfg), float("-inf"))
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if cfg.renormalize:
        eps = 1e-20 if cfg.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if cfg.scaling_factor != 1.0:
        weights = weights * cfg.scaling_factor
    return weights, ids.to(torch.int32)
