"""Attention backend registry: the torch reference everywhere, device kernels where they exist."""

from __future__ import annotations

import importlib

from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk

# name -> "module:Class"; modules are imported only when selected (the npu one imports torch_npu).
_BACKENDS = {
    "torch": "pdcluster.engine.attention.torch_backend:TorchAttentionBackend",
    "cpu": "pdcluster.engine.attention.cpu_backend:CpuAttentionBackend",
    "npu": "pdcluster.engine.attention.npu_backend:NpuAttentionBackend",
    "flashinfer": "pdcluster.engine.attention.flashinfer_backend:FlashInferAttentionBackend",
}
_DEFAULT_FOR_DEVICE = {"cpu": "cpu", "cuda": "torch", "npu": "npu"}


def _flashinfer_imports() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:   # missing, or built for another torch / CUDA
        return False
    return True


def register_backend(name: str, target: str) -> None:
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str | None, device_type: str = "cpu"):
    if name is None and device_type == "cuda" and _flashinfer_imports():
        name = "flashinfer"
    if name is None and device_type == "cpu":
        import torch

        from pdcluster.engine.device import device_kind  # "npu" for the torch_npu emulator's CPU tensors

        device_type = device_kind(torch.device("cpu"))
    name = name or _DEFAULT_FOR_DEVICE.get(device_type, "torch")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionMetadata", "PrefillChunk", "get_backend_class", "register_backend", "available_backends"]
