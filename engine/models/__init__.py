"""Architecture registry: HF `architectures` name -> model class."""

from __future__ import annotations

from pdcluster.engine.config import SUPPORTED_ARCHITECTURES
from pdcluster.engine.models.llama import LlamaForCausalLM
from pdcluster.engine.models.qwen2 import Qwen2ForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; its sliding window (`sliding_window`, every layer) is in `ModelConfig.layer_windows`."""


MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(MODEL_REGISTRY)
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported}") from None
