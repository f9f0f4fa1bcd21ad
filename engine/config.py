"""Model and engine configuration.

`ModelConfig` is read from a HF `config.json` (both the transformers 4 `rope_theta`/`rope_scaling`
keys and the transformers 5 `rope_parameters` key). The engine knobs are `engine.args.EngineArgs`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.engine.args import dtype_name
from pdcluster.engine.layers.moe_routing import RoutingConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV3ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                       "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype_name(dtype))


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` in hardware through oneDNN (bf16: AVX512-BF16 / AMX; fp16:
    AVX512-FP16 / AMX-FP16). Where it does not, oneDNN emulates the type and is slower than float32."""
    if dtype == torch.float32:
        return True
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        pass
    return False


@functools.cache
def cpu_has_amx(dtype: torch.dtype) -> bool:
    """Whether this CPU has AMX tiles for `dtype` (bf16: AMX-BF16, Sapphire Rapids on; fp16: AMX-FP16, Granite
    Rapids on): oneDNN's GEMMs, torch's CPU flash attention among them, then run on the tiles."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.cpu._is_amx_tile_supported())
        if dtype == torch.float16:
            return bool(torch.cpu._is_amx_fp16_supported())
    except AttributeError:   # a torch without the probes
        pass
    return False


def checkpoint_dtype(model_dir: str) -> torch.dtype | None:
    """The `torch_dtype` (transformers 5: `dtype`) a checkpoint's config.json names; None if it names none."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    name = cfg.get("torch_dtype") or cfg.get("dtype") if isinstance(cfg, dict) else None
    try:
        return parse_dtype(name) if isinstance(name, str) else None
    except (ValueError, AttributeError):
        return None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, model_dir: str) -> torch.dtype:
    """`EngineArgs.dtype` as a torch dtype. "auto" is the checkpoint's `torch_dtype` (bfloat16 when config.json
    names none), as in vLLM, except: on cuda a float32 checkpoint runs in bfloat16 (FlashInfer's kernels and the
    tensor cores take 16-bit types); on CPU a 16-bit checkpoint runs in its dtype only where the CPU computes it
    natively (`cpu_computes_natively`), else in float32, and a float32 checkpoint stays float32 (vLLM downcasts
    it to bfloat16: pass `dtype: bfloat16` for that; the tests' references are float32 checkpoints)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    found = checkpoint_dtype(model_dir) or torch.bfloat16
    if device.type == "cpu":
        return found if cpu_computes_natively(found) else torch.float32
    return torch.bfloat16 if device.type == "cuda" and found == torch.float32 else found


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (engine/layers/mla.py): queries through an optional low-rank
    `q_lora_rank`, keys and values up-projected from a `kv_lora_rank` latent, a `qk_rope_head_dim` rotary part
    shared by the heads."""
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool   # the checkpoint's rope dims come in (x0, x1) pairs (V2 always; V3 `rope_interleave`)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (engine/layers/moe.py FusedMoE): the layers that have them in place of the dense MLP, the
    experts' size and how tokens are routed to them."""
    num_experts: int
    top_k: int
    intermediate_size: int            # per expert (moe_intermediate_size; Mixtral's intermediate_size)
    sparse_layers: tuple[int, ...]    # layer indices with routed experts; the others keep a dense GatedMLP
    norm_topk_prob: bool = True
    scoring: str = "softmax"          # "softmax" | "sigmoid"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False     # e_score_correction_bias (DeepSeek-V3)
    group_score: str = "top2_sum"
    expert_parallel: bool = False     # whole experts per tensor-parallel rank instead of slices of every expert

    def routing(self) -> RoutingConfig:
        return RoutingConfig(self.num_experts, self.top_k, self.scoring, self.norm_topk_prob, self.num_groups,
                             self.topk_groups, self.routed_scaling_factor, self.group_score)


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
    # MLA (DeepSeek): the KV pool caches one latent row per token and layer, kv_lora_rank + qk_rope_head_dim
    # values (engine/kv_cache.py); 0: per-head K and V
    kv_latent_dim: int = 0
    mla: MLAConfig | None = None
    qk_norm: bool = False             # RMSNorm over each query / key head before the rotary (Qwen3)
    moe: MoEConfig | None = None
    shared_expert_intermediate_size: int = 0   # DeepSeek: the shared experts beside the routed ones, one GatedMLP
    # a quantized checkpoint's format and schemes (engine/quant/formats.py `CheckpointQuant`); None: float weights
    quantization: Any = None

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
            **_mla_fields(cfg, arch),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            moe=_moe_config(cfg, arch),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model: directory {model_dir!r} does not exist (expected a HF model directory)")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: {path} is missing (expected config.json in the HF model directory)")
        with open(path) as f:
            raw = json.load(f)
        config = cls.from_dict(raw)
        from pdcluster.engine.quant.formats import read_checkpoint_quant

        config.quantization = read_checkpoint_quant(model_dir, raw)
        return config


_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _mla_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: `mla` and the latent row of the KV pool (kv_latent_dim); nothing for other architectures."""
    if arch not in _MLA_ARCHITECTURES:
        return {}
    mla = MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank"),
                    qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                    v_head_dim=cfg["v_head_dim"],
                    rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))
    shared = (cfg.get("n_shared_experts") or 0) * cfg.get("moe_intermediate_size", 0)
    return dict(mla=mla, kv_latent_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
                shared_expert_intermediate_size=shared if cfg.get("n_routed_experts") else 0)


def _deepseek_moe(cfg: dict[str, Any], arch: str) -> MoEConfig:
    """Experts from layer `first_k_dense_replace` on, every `moe_layer_freq`-th (DeepSeek's and vLLM's rule; the
    checkpoints set 1). V2: softmax scores, `topk_method` greedy or group_limited_greedy (groups ranked by their
    best score); V3: sigmoid scores with the correction bias (noaux_tc), groups ranked by their top-two sum.
    `norm_topk_prob` is honoured for V2 as DeepSeek's own code and vLLM do (transformers' V2 router never
    renormalizes; the released V2 / V2-Lite configs set it false)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method {method!r} is not supported; supported: greedy, group_limited_greedy, "
                         "noaux_tc")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    grouped = method != "greedy"
    first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    return MoEConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["moe_intermediate_size"],
                     sparse_layers=tuple(i for i in range(cfg["num_hidden_layers"]) if i >= first and i % freq == 0),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)), scoring=scoring,
                     num_groups=(cfg.get("n_group") or 1) if grouped else 1,
                     topk_groups=(cfg.get("topk_group") or 1) if grouped else 1,
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                     correction_bias=method == "noaux_tc", group_score="top2_sum" if method == "noaux_tc" else "max")


def _moe_config(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """Qwen3-MoE: experts on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (transformers'
    Qwen3MoeDecoderLayer rule); Mixtral: on every layer, always renormalized."""
    layers = range(cfg["num_hidden_layers"])
    if arch in _MLA_ARCHITECTURES and cfg.get("n_routed_experts"):
        return _deepseek_moe(cfg, arch)
    # Hub configs say num_experts (Qwen) / num_local_experts (Mixtral); transformers 5 writes num_local_experts
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if arch == "Qwen3MoeForCausalLM" and experts > 0:
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        return MoEConfig(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                         intermediate_size=cfg["moe_intermediate_size"],
                         sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=experts or 8, top_k=cfg.get("num_experts_per_tok", 2),
                         intermediate_size=cfg["intermediate_size"], sparse_layers=tuple(layers))
    return None


def _layer_windows(cfg: dict[str, Any], arch: str) -> list[int]:
    """Sliding-window size of each layer (0: full attention), read as transformers reads these configs:
    Mistral windows every layer (`sliding_window`, 4096 when the key is absent, null = none); Mixtral every layer
    when `sliding_window` is set; Qwen3-MoE every layer with `use_sliding_window`; Qwen2 and Qwen3 only with
    `use_sliding_window`, on the `layer_types` marked "sliding_attention" (default: layers from
    `max_window_layers` on); Llama has none."""
    layers = cfg["num_hidden_layers"]
    if arch == "MistralForCausalLM":
        return [cfg.get("sliding_window", 4096) or 0] * layers
    if arch == "MixtralForCausalLM":
        return [cfg.get("sliding_window") or 0] * layers
    if arch == "Qwen3MoeForCausalLM":
        return [cfg["sliding_window"] if cfg.get("use_sliding_window") and cfg.get("sliding_window") else 0] * layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first_sliding = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first_sliding else "full_attention"
                                           for i in range(layers)]
        return [cfg["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    return [0] * layers
