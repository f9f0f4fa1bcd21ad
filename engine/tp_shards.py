"""How a converted checkpoint is split across tensor-parallel ranks (Megatron layout; docs/engine.md).

Column-parallel (output rows split): q/k/v projections by heads, gate/up by intermediate rows. KV heads are
split across ranks while there are at least as many as ranks; with fewer, each rank holds a copy of the one
KV head its query heads use (rank r: KV head r * num_kv_heads // tp). Row-parallel (input columns split):
o_proj, down_proj. Vocab-parallel (rows split): embed_tokens, lm_head. Everything else (norms) is replicated.

MLA (DeepSeek-V2/V3, engine/layers/mla.py): q_proj / q_b_proj and kv_b_proj are column-parallel by heads, o_proj
row-parallel; q_a_proj, kv_a_proj_with_mqa and their layernorms are replicated, as is the latent KV cache they
produce (every rank up-projects its own heads from the whole latent), so num_key_value_heads does not constrain tp.

Routed experts (engine/layers/moe.py FusedMoE): without expert parallelism every expert is sliced like a GatedMLP
(gate/up and Mixtral's w1/w3 by intermediate rows, down / w2 by columns; the fused transformers-5 tensors
experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I] the same way per expert). With it
(`config.moe.expert_parallel`) rank r holds whole experts [r * E / tp, (r + 1) * E / tp): another rank's expert
tensors are not read at all (`holds`), the fused tensors are cut along the expert dim. The router (gate) and its
e_score_correction_bias are replicated; shared experts are a GatedMLP, sliced as one.
"""

from __future__ import annotations

import re
from typing import Any

from pdcluster.device import rank_kv_heads
from pdcluster.engine.config import ModelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")
# one tensor per routed expert and projection (Qwen-MoE / DeepSeek gate/up/down_proj, Mixtral w1/w3/w2), and the
# fused per-layer tensors transformers 5 writes
_EXPERT = re.compile(r"\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED_EXPERTS = re.compile(r"\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def rank_file(rank: int, tp: int) -> str:
    return f"model-rank{rank}-of-{tp}.safetensors"


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the config field that `tp` ranks cannot split evenly."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
    if config.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide num_attention_heads {config.num_heads}")
    kv = config.num_kv_heads
    if not config.kv_latent_dim and ((kv >= tp and kv % tp) or (kv < tp and tp % kv)):
        raise ValueError(f"tensor_parallel_size {tp} and num_key_value_heads {kv}: one must divide the other")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide intermediate_size {config.intermediate_size}")
    moe = config.moe
    if moe is not None and moe.expert_parallel and moe.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} does not divide num_experts "
                         f"{moe.num_experts} (each rank holds num_experts / tensor_parallel_size whole experts)")
    if moe is not None and not moe.expert_parallel and moe.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide moe_intermediate_size {moe.intermediate_size} "
                         f"(or run with enable_expert_parallel: whole experts per rank)")
    if config.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the shared experts' intermediate size "
                         f"{config.shared_expert_intermediate_size}")


def split_dim(name: str) -> int | None:
    """0 (rows), 1 (columns) or None (replicated) for a HF tensor name; biases follow their weight's rows."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    expert = _EXPERT.search(name)
    if expert is not None:
        return 1 if expert["proj"] in ("down_proj", "w2") else 0
    fused = _FUSED_EXPERTS.search(name)
    if fused is not None:
        return 2 if fused["proj"] == "down_proj" else 1
    if module in COLUMN or module in VOCAB:
        return 0
    if module in ROW:
        return 1 if name.endswith(".weight") else None   # a row-parallel bias is added once, after the reduce
    return None


def split_range(length: int, rank: int, tp: int) -> tuple[int, int]:
    """(start, size) of rank's part when `length` splits over `tp` ranks as torch.tensor_split does: the
    first `length % tp` ranks get one more."""
    base, extra = divmod(length, tp)
    return rank * base + min(rank, extra), base + (rank < extra)


def local_kv_heads(config: ModelConfig, tp: int) -> int:
    """KV heads each rank holds: a share of them, or one replicated head when there are fewer than ranks."""
    return len(rank_kv_heads(config.num_kv_heads, 0, tp))


def expert_parallel(config: ModelConfig) -> bool:
    return config.moe is not None and config.moe.expert_parallel


def expert_range(config: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """(first, count) of the routed experts rank holds: num_experts / tp whole ones under expert parallelism,
    else all of them (each sliced)."""
    experts = config.moe.num_experts if config.moe is not None else 0
    if not expert_parallel(config) or tp == 1:
        return 0, experts
    return rank * (experts // tp), experts // tp


def holds(name: str, config: ModelConfig, rank: int, tp: int) -> bool:
    """Whether rank reads tensor `name` at all: False only for another expert-parallel rank's expert."""
    expert = _EXPERT.search(name)
    if expert is None or tp == 1 or not expert_parallel(config):
        return True
    first, count = expert_range(config, rank, tp)
    return first <= int(expert["expert"]) < first + count


def shard_parts(name: str, shape: tuple[int, ...], config: ModelConfig, rank: int,
                tp: int) -> list[tuple[int, int, int]] | None:
    """Rank's part of tensor `name` as (dim, start, size) slices to concatenate along their dim (one slice, but
    two for a fused gate_up_proj sliced per expert: its gate rows, then its up rows); None: the whole tensor."""
    fused = _FUSED_EXPERTS.search(name)
    if fused is None or fused["proj"] != "gate_up_proj" or tp == 1 or expert_parallel(config):
        part = shard_slice(name, shape, config, rank, tp)
        return None if part is None else [part]
    half = shape[1] // 2
    start, size = split_range(half, rank, tp)
    return [(1, start, size), (1, half + start, size)]


def shard_slice(name: str, shape: tuple[int, ...], config: ModelConfig, rank: int,
                tp: int) -> tuple[int, int, int] | None:
    """(dim, start, size) of rank's part of the full tensor `name` of `shape`; None: the whole tensor. A fused
    gate_up_proj sliced per expert is two slices: `shard_parts`."""
    dim = split_dim(name)
    if tp == 1 or dim is None:
        return None
    fused = _FUSED_EXPERTS.search(name) is not None
    if expert_parallel(config) and _EXPERT.search(name):
        return None   # a whole expert of this rank's (`holds`)
    if expert_parallel(config) and fused:
        return (0, *expert_range(config, rank, tp))
    if fused and dim == 1:
        raise ValueError(f"{name}: a fused gate_up_proj is two slices per rank (shard_parts)")
    module = name.rsplit(".", 2)[-2]
    if module in ("k_proj", "v_proj") and config.num_kv_heads < tp:
        head = rank_kv_heads(config.num_kv_heads, rank, tp).start
        return 0, head * config.head_dim, config.head_dim
    return (dim, *split_range(shape[dim], rank, tp))


def shard(name: str, tensor: Any, config: ModelConfig, rank: int, tp: int) -> Any:
    """This rank's part of one full tensor (a view; `.contiguous()` before saving)."""
    parts = shard_parts(name, tuple(tensor.shape), config, rank, tp)
    if parts is None:
        return tensor
    if len(parts) == 1:
        return tensor.narrow(*parts[0])
    import torch

    return torch.cat([tensor.narrow(*part) for part in parts], dim=parts[0][0])
