"""What a request names to run under an adapter, and the engine's LoRA knobs (vLLM's names). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: an adapter by name, a positive integer id, and its PEFT checkpoint directory
    (adapter_config.json + adapter_model.safetensors). The name identifies it inside one engine."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an int >= 1, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapters resident in the device slot table, each of rank <= `max_lora_rank`; up to
    `max_cpu_loras` loaded adapters kept in host memory (LRU) to refill slots without reading the disk."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
