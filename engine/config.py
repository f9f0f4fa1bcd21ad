"""Model and engine configuration.

`ModelConfig` is read from a HF `config.json` (both the transformers 4 `rope_theta`/`rope_scaling`
keys and the transformers 5 `rope_parameters` key). The engine knobs are `engine.args.EngineArgs`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.engine.args import dtype_name

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype_name(dtype))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, model_dir: str) -> torch.dtype:
    """`EngineArgs.dtype` as a torch dtype. "auto" (as in vLLM): float32 on CPU (bf16 GEMV is slow there),
    else the checkpoint's `torch_dtype` (bfloat16 when config.json names none); on cuda a float32 checkpoint
    runs in bfloat16 too (FlashInfer's kernels and the tensor cores take 16-bit types)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return torch.bfloat16
    found = parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return torch.bfloat16 if device.type == "cuda" and found == torch.float32 else found


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

    @property
    def kv_window(self) -> int:
        """The window bounding what every layer reads (its largest window), or 0 when a layer attends to
        everything: KV older than this is dead for all layers and its blocks can be released."""
        windows = self.layer_windows
        return max(windows) if windows and all(w > 0 for w in windows) else 0

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
        if scaling is not None and rope_type not in ("llama3", "yarn", "linear"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: llama3, yarn, linear")
        max_len = cfg.get("max_position_embeddings", 2048)
        # yarn: transformers' defaults, resolved here (max_model_len may be lowered later)
        if scaling is not None and rope_type == "yarn":
            if "original_max_position_embeddings" in cfg:   # a top-level key wins, as in transformers
                scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", max_len)
            if scaling.get("factor") is None:
                scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
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


def _layer_windows(cfg: dict[str, Any], arch: str) -> list[int]:
    """Sliding-window size of each layer (0: full attention), read as transformers reads these configs:
    Mistral windows every layer (`sliding_window`, 4096 when the key is absent, null = none); Qwen2 only with
    `use_sliding_window`, on the `layer_types` marked "sliding_attention" (default: layers from
    `max_window_layers` on); Llama has none."""
    layers = cfg["num_hidden_layers"]
    if arch == "MistralForCausalLM":
        return [cfg.get("sliding_window", 4096) or 0] * layers
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first_sliding = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first_sliding else "full_attention"
                                           for i in range(layers)]
        return [cfg["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    return [0] * layers
