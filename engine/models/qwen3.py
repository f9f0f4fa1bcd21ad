"""Qwen3: the Llama graph with an RMSNorm over each query and key head before the rotary (`config.qk_norm`), no
QKV bias, tied or untied embeddings, sliding window on the layers `layer_types` marks (as Qwen2)."""

from __future__ import annotations

from pdcluster.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
