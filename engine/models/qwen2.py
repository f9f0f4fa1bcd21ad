"""Qwen2: the Llama graph with QKV bias (set from the config) and, usually, tied embeddings."""

from __future__ import annotations

from pdcluster.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
