"""Engine arguments (vLLM names). Torch-free: the root package exports them and the router imports the
root, so nothing here may pull in torch. dtype names are checked as strings; `parse_dtype` in
`engine.config` turns them into torch dtypes when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}


def dtype_name(dtype: Any) -> str:
    """Canonical name ("float32", "bfloat16", "float16") of a dtype given as a name or a torch.dtype."""
    text = str(dtype).lower()
    text = text[len("torch."):] if text.startswith("torch.") else text
    try:
        return DTYPE_NAMES[text]
    except KeyError:
        raise ValueError(f"dtype: unsupported {dtype!r}; expected float32, bfloat16 or float16") from None


@dataclass
class EngineArgs:
    """Engine knobs; names follow vLLM."""

    model: str
    dtype: Any = "float32"                      # a name from DTYPE_NAMES or a torch.dtype
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None          # bytes for the KV pool; overrides gpu_memory_utilization
    gpu_memory_utilization: float = 0.9         # fraction of free device memory (CPU: available RAM, capped)
    num_gpu_blocks_override: int | None = None  # exact pool size in blocks (tests)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    attention_backend: str | None = None        # None: chosen by device
    kv_pool_tensor: Any = None                  # externally allocated pool tensor (e.g. shm-backed), block-major
    kv_pool_factory: Callable[[tuple[int, ...], Any], Any] | None = None   # (shape, torch dtype) -> tensor
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: tensor parallelism is not implemented yet (use 1)")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        dtype_name(self.dtype)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The same knobs for `AsyncLLMEngine.from_engine_args` (vLLM keeps the two names)."""
