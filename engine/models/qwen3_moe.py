"""Qwen3-MoE: Qwen3's attention; the layers `config.moe.sparse_layers` names (every `decoder_sparse_step`-th, less
`mlp_only_layers`) route each token to its top-k experts by softmax (renormalized when `norm_topk_prob`), the others
keep a dense MLP. Checkpoint names (mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj, or the fused
mlp.experts.gate_up_proj / down_proj) are placed by engine/layers/moe.py load_moe_tensor."""

from __future__ import annotations

from pdcluster.engine.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass
