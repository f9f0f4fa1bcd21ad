"""Attention backend registry: the torch reference everywhere, device kernels where they exist."""

from __future__ import annotations

import importlib

from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk

# name -> "module:Class"; modules are imported only when selected (the npu one imports torch_npu).
_BACKENDS = {
    "torch": "pdcluster.engine.attention.torch_backend:TorchAttentionBackend",
    "cpu": "pdcluster.engine.attention.cpu_backend:CpuAttentionBackend",
    "npu": "pdcluster.engine.attention.npu_backend:NpuAttentionBackend",
}
_DEFAULT_FOR_DEVICE = {"cpu": "cpu", "cuda": "torch", "npu": "npu"}


def register_backend(name: str, target: str) -> None:
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str | None, device_type: str = "cpu"):
    name = name or _DEFAULT_FOR_DEVICE.get(device_type, "torch")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionMetadata", "PrefillChunk", "get_backend_class", "register_backend", "available_backends"]
