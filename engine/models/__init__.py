"""Architecture registry: HF `architectures` name -> model class."""

from __future__ import annotations

from pdcluster.engine.config import SUPPORTED_ARCHITECTURES
from pdcluster.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdcluster.engine.models.llama import LlamaForCausalLM
from pdcluster.engine.models.mixtral import MixtralForCausalLM
from pdcluster.engine.models.qwen2 import Qwen2ForCausalLM
from pdcluster.engine.models.qwen3 import Qwen3ForCausalLM
from pdcluster.engine.models.qwen3_moe import Qwen3MoeForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; its sliding window (`sliding_window`, every layer) is in `ModelConfig.layer_windows`."""


MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(MODEL_REGISTRY)
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported}") from None
