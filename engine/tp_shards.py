"""How a converted checkpoint is split across tensor-parallel ranks (Megatron layout; docs/engine.md).

Column-parallel (output rows split): q/k/v projections by heads, gate/up by intermediate rows. KV heads are
split across ranks while there are at least as many as ranks; with fewer, each rank holds a copy of the one
KV head its query heads use (rank r: KV head r * num_kv_heads // tp). Row-parallel (input columns split):
o_proj, down_proj. Vocab-parallel (rows split): embed_tokens, lm_head. Everything else (norms) is replicated.
"""

from __future__ import annotations

from typing import Any

from pdcluster.engine.config import ModelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def rank_file(rank: int, tp: int) -> str:
    return f"model-rank{rank}-of-{tp}.safetensors"


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the config field that `tp` ranks cannot split evenly."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
    if config.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide num_attention_heads {config.num_heads}")
    kv = config.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"tensor_parallel_size {tp} and num_key_value_heads {kv}: one must divide the other")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide intermediate_size {config.intermediate_size}")


def split_dim(name: str) -> int | None:
    """0 (rows), 1 (columns) or None (replicated) for a HF tensor name; biases follow their weight's rows."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
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
    return max(1, config.num_kv_heads // tp)


def shard_slice(name: str, shape: tuple[int, ...], config: ModelConfig, rank: int,
                tp: int) -> tuple[int, int, int] | None:
    """(dim, start, size) of rank's part of the full tensor `name` of `shape`; None: the whole tensor."""
    dim = split_dim(name)
    if tp == 1 or dim is None:
        return None
    module = name.rsplit(".", 2)[-2]
    if module in ("k_proj", "v_proj") and config.num_kv_heads < tp:
        head = rank * config.num_kv_heads // tp
        return 0, head * config.head_dim, config.head_dim
    return (dim, *split_range(shape[dim], rank, tp))


def shard(name: str, tensor: Any, config: ModelConfig, rank: int, tp: int) -> Any:
    """This rank's part of one full tensor (a view; `.contiguous()` before saving)."""
    part = shard_slice(name, tuple(tensor.shape), config, rank, tp)
    return tensor if part is None else tensor.narrow(*part)
