"""Model and engine configuration.

`ModelConfig` is read from a HF `config.json` (both the transformers 4 `rope_theta`/`rope_scaling`
keys and the transformers 5 `rope_parameters` key). `EngineArgs` carries the vLLM-named knobs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {dtype}; expected float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype: unsupported {dtype!r}; expected float32, bfloat16 or float16") from None


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    layer_windows: list[int] = field(default_factory=list)   # sliding window per layer, 0 = full attention

    def layer_window(self, index: int) -> int:
        return self.layer_windows[index] if self.layer_windows else 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""))
        if arch is None:
            named = archs or [cfg.get("model_type")]
            raise ValueError(f"architecture {named} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        if legacy and not rope.get("rope_type"):
            rope.update(legacy)
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        if scaling is not None and rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: llama3, linear")
        max_len = cfg.get("max_position_embeddings", 2048)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_model_len=max_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=cfg.get("bos_token_id"),
            layer_windows=_layer_windows(cfg, arch),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model: directory {model_dir!r} does not exist (expected a HF model directory)")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: {path} is missing (expected config.json in the HF model directory)")
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclass
class EngineArgs:
    """Engine knobs; names follow vLLM."""

    model: str
    dtype: str | torch.dtype = "float32"
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
    kv_pool_tensor: torch.Tensor | None = None  # externally allocated pool (e.g. shm-backed), block-major shape
    kv_pool_factory: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
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
        parse_dtype(self.dtype)


def _layer_windows(cfg: dict[str, Any], arch: str) -> list[int]:
    """Sliding-window size of each layer (0: full attention), read as transformers reads these configs:
    Mistral windows every layer (`sliding_window`, 4096 when the key is absent, null = none); Qwen2 only with
    `use_sliding_window`, on the `layer_types` marked "sliding_attention" (default: layers from
    `max_window_layers` on); Llama has none."""
    layers = cfg["num_hidden_layers"]
    if arch == "MistralForCausalLM":
        return [cfg.get("sliding_window", 4096) or 0] * layers
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                                           for i in range(layers)]
        return [cfg["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    return [0] * layers
