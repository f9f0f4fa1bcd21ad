"""Mixtral: the Mistral graph with every MLP a top-2 softmax MoE (renormalized), sliding window when the config sets
one. Its checkpoints name the block `block_sparse_moe` and the experts' projections w1 / w3 / w2 (gate / up /
down), read here as the `mlp` FusedMoE of the shared Llama code."""

from __future__ import annotations

from typing import Iterable

import torch

from pdcluster.engine.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
