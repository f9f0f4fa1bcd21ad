"""Engine arguments (vLLM names). Torch-free: the root package exports them and the router imports the
root, so nothing here may pull in torch. dtype names are checked as strings; `resolve_dtype` in
`engine.config` turns them (and "auto") into torch dtypes when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdcluster.control.config import knob, parse_bytes
from pdcluster.engine.lora.request import LoRAConfig
from pdcluster.engine.speculative.config import SpeculativeConfig, as_text
from pdcluster.engine.weight_pool import SharedWeightPool, parse_spec

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")  # what a config file or flag may say
DEVICE_CHOICES = ("auto", "npu", "cuda", "cpu")
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")


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
    """Engine knobs; names and meanings follow vLLM. This is the one declaration of them: the node config,
    its env variables and the `pdcluster prefill|decode` flags are derived from these fields (their
    metadata: help text, choices, and `setting=False` for the two that only code can pass)."""

    model: str = knob(help="HF checkpoint directory")
    dtype: str | torch.dtype = knob("auto", choices=DTYPE_CHOICES,
                                    help="weights and KV dtype; auto: float32 on CPU, else the checkpoint's "
                                         "(bfloat16 for a float32 one on cuda)")
    device: str | None = knob(None, choices=DEVICE_CHOICES, help="auto: npu > cuda > cpu")
    block_size: int | None = knob(None, help="tokens per KV block; unset (0): 128 on CPU and NPU (vLLM-CPU's and "
                                             "vLLM-Ascend's default), 16 on CUDA")
    kv_cache_dtype: str = knob("auto", choices=KV_CACHE_DTYPE_CHOICES,
                               help="KV pool dtype; auto: the model dtype, int8: int8 with a scale per token "
                                    "and KV head")
    kv_cache_memory: int | None = knob(None, parse=parse_bytes,
                                       help="KV pool bytes, e.g. 4GiB; unset (0): derived from "
                                            "gpu_memory_utilization")
    gpu_memory_utilization: float = knob(0.9, help="fraction of free device memory for weights, activations "
                                                   "and KV (CPU: available RAM, capped)")
    num_gpu_blocks_override: int | None = knob(None, help="exact KV pool size in blocks; unset (0): derived")
    max_num_seqs: int = knob(256, help="max concurrently running sequences")
    max_num_batched_tokens: str | int = knob(2048, help="token budget of one engine step (the prefill chunk); "
                                                        "auto: a quarter of max_model_len within [2048, 4096]")
    max_model_len: int | None = knob(None, help="context limit; unset (0): the model's max_position_embeddings")
    max_context_len_to_capture: int | None = knob(None, help="vLLM: longest context run in a captured CUDA graph; "
                                                             "accepted, no effect (no graph capture here)")
    attention_sinks: int = knob(0, help="StreamingLLM: first tokens every sequence keeps (rounded up to whole "
                                        "blocks); needs streaming_window")
    streaming_window: int = knob(0, help="StreamingLLM: recent tokens kept besides the sinks; > 0: constant KV per "
                                         "sequence and generation past max_model_len (0: off)")
    enable_chunked_prefill: bool = knob(True, help="split long prompts over several steps")
    enable_prefix_caching: bool = knob(True, help="reuse cached full KV blocks of earlier prompts")
    prefix_cache_salt: str = knob("", help="mixed into every KV block hash (with the model, dtypes and layout), so "
                                           "engines with different salts never share prefix blocks; a node "
                                           "uses its cluster's name when empty")
    kv_offload_host_bytes: int = knob(0, parse=parse_bytes,
                                      help="host-memory KV tier, e.g. 8GiB: prefix-cached blocks are copied there "
                                           "(LRU) and loaded back on a hit instead of recomputed; 0: off")
    kv_offload_disk_path: str = knob("", help="directory of the disk KV tier (one file per block; one directory "
                                              "per node); empty: off")
    kv_offload_disk_bytes: int = knob(0, parse=parse_bytes,
                                      help="disk KV tier size, e.g. 100GiB: blocks evicted from the host tier are "
                                           "written there (LRU); 0: off")
    tensor_parallel_size: int = knob(1, help="devices (processes) one engine spans; heads and intermediate size "
                                             "must split evenly (gloo on CPU, nccl on CUDA, hccl on NPU)")
    enable_expert_parallel: bool = knob(False, help="MoE models: whole experts per tensor-parallel rank (expert "
                                                    "parallel size = tensor_parallel_size; num_experts must split "
                                                    "evenly) instead of a slice of every expert; attention stays "
                                                    "tensor-parallel")
    collective_timeout: float = knob(60.0, help="seconds a tensor-parallel collective (or a rank joining) may "
                                                "take before the engine fails naming the rank")
    kv_pool_per_rank: bool = knob(False, help="tensor parallelism: each rank allocates its own slice of the KV pool in "
                                              "its own process and KV moves rank to rank, each over its own "
                                              "channel (always so on a device); false on CPU: one shared pool "
                                              "holds every rank's heads")
    attention_backend: str | None = knob(None, help="attention backend name; unset: chosen by device")
    enforce_eager: bool = knob(True, help="run the model eagerly; false: torch.compile the model body "
                                          "(tensor_parallel_size 1, cached on disk)")
    seed: int = knob(0, help="base seed of the sampler")
    speculative_config: str | dict | SpeculativeConfig | None = knob(
        None, parse=as_text,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}; '
             'outputs are those of the model without it (docs/speculative_decoding.md)')
    # In code also a SharedWeightPool object; a config names one as NAME:SIZE (engine/weight_pool.py).
    weight_pool: str | SharedWeightPool | None = knob(
        None, help="share read-only weights with the engines on this host naming the same pool: NAME[:SIZE] "
                   "(e.g. models:8GiB; no SIZE: what /dev/shm holds; CPU only); unset: private weights")
    # LoRA (engine/lora/, vLLM's names; docs/engine.md "Multi-LoRA").
    enable_lora: bool = knob(False, help="serve LoRA adapters on this base model (PEFT checkpoints)")
    max_loras: int = knob(1, help="LoRA adapters resident in the device slot table at once (one step mixes at most "
                                  "this many)")
    max_lora_rank: int = knob(16, help="the slot table's rank: every adapter's r must fit")
    max_cpu_loras: int | None = knob(None, help="loaded adapters kept in host memory (LRU); unset: max_loras")
    # in code also {name: path}
    lora_modules: dict[str, str] | list[str] | str | None = knob(
        None, help="adapters loaded at start: name=path (comma-separated); needs enable_lora")
    # Only code passes these two: an externally allocated pool tensor (e.g. shm-backed, layer-major), or a
    # factory (shape, torch dtype) -> tensor, or None for the engine's own pool (engine/kv_cache.py `make_pool`;
    # tensor-parallel ranks on CPU map the tensor: torch shared memory or a shared mapping of a file).
    kv_pool_tensor: Any = knob(None, setting=False)
    kv_pool_factory: Callable[[tuple[int, ...], Any], Any] | None = knob(None, setting=False)

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA knobs as one config; None without enable_lora."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    def lora_paths(self) -> dict[str, str]:
        """`lora_modules` as {name: path}."""
        modules = self.lora_modules
        if not modules:
            return {}
        if isinstance(modules, dict):
            return {str(k): str(v) for k, v in modules.items()}
        items = modules.split(",") if isinstance(modules, str) else modules
        paths: dict[str, str] = {}
        for item in items:
            name, eq, path = str(item).strip().partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
            paths[name.strip()] = path.strip()
        return paths

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config`, parsed (by __post_init__)."""
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)
        return spec

    def __post_init__(self) -> None:
        if self.collective_timeout <= 0:
            raise ValueError(f"collective_timeout: must be > 0, got {self.collective_timeout}")
        if isinstance(self.max_num_batched_tokens, str):   # a number from a config or flag, or "auto"
            text = self.max_num_batched_tokens.strip().lower()
            self.max_num_batched_tokens = text if text == "auto" else int(text)
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            setattr(self, name, parse_bytes(getattr(self, name) or 0))
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        self.kv_offload_disk_path = self.kv_offload_disk_path or ""
        if bool(self.kv_offload_disk_path) != (self.kv_offload_disk_bytes > 0):
            raise ValueError("kv_offload_disk_path and kv_offload_disk_bytes: the disk KV tier needs both (got "
                             f"path {self.kv_offload_disk_path!r}, {self.kv_offload_disk_bytes} bytes)")
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                     "num_gpu_blocks_override", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value != "auto" and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                             f"({self.max_model_len}) needs enable_chunked_prefill")
        if self.dtype != "auto":
            dtype_name(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: needs enable_lora")
        self.lora_config()   # checks max_loras, max_lora_rank, max_cpu_loras
        self.lora_paths()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and (self.streaming_window or self.attention_sinks):
            raise ValueError("speculative_config: not available with StreamingLLM (streaming_window, attention_sinks)")
        if isinstance(self.weight_pool, str):
            parse_spec(self.weight_pool)
        elif self.weight_pool is not None and not isinstance(self.weight_pool, SharedWeightPool):
            raise ValueError(f"weight_pool: expected NAME[:SIZE] or a SharedWeightPool, got {self.weight_pool!r}")


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The same knobs for `AsyncLLMEngine.from_engine_args` (vLLM keeps the two names)."""
