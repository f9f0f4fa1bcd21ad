"""DeepSeek-V2 and DeepSeek-V3 (V2-Lite: no q LoRA; R1 is the V3 graph): MLA attention over the latent KV pool
(engine/layers/mla.py), and per layer a dense SwiGLU MLP or a mixture of experts with shared experts.

A layer is MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th one (`MoEConfig.sparse_layers`,
engine/config.py). The MoE block: the routed experts (FusedMoE; V2 softmax scores, greedy or group-limited by
each group's best score; V3 sigmoid scores with `e_score_correction_bias` for the choice, groups ranked by the
sum of their top two) times `routed_scaling_factor`, plus the shared experts, one GatedMLP of
moe_intermediate_size * n_shared_experts. DeepSeek-V3's multi-token-prediction layers (indices from
num_hidden_layers on) are not run, and their tensors are skipped.

Checkpoint experts load per expert (`mlp.experts.{e}.gate_proj.weight`, the Hub layout and what transformers 5
saves) or stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.embedding import VocabEmbedding
from pdcluster.engine.layers.layernorm import RMSNorm, load_norm_bias, norm_tensor_name
from pdcluster.engine.layers.linear import Linear, MergedLinear
from pdcluster.engine.layers.mla import MLAttention
from pdcluster.engine.layers.mlp import GatedMLP
from pdcluster.engine.layers.moe import FusedMoE
from pdcluster.engine.layers.rotary import RotaryEmbedding
from pdcluster.engine.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, copy_tensor
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.quant.scheme import QuantizedWeight

_GATE_UP = {"gate_proj": "gate", "up_proj": "up"}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.experts = FusedMoE(moe.num_experts, config.hidden_size, moe.intermediate_size, moe.routing(), tp,
                                expert_parallel=moe.expert_parallel, correction_bias=moe.correction_bias,
                                router_fp32=True)
        shared = config.shared_expert_intermediate_size
        self.shared_experts = GatedMLP(config.hidden_size, shared, tp) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def deepseek_layer(config: ModelConfig, backend, index: int, tp: TPGroup) -> DecoderLayer:
    """Llama's pre-norm layer with MLA attention, and DeepseekMoE on the MoE config's sparse layers."""
    moe = config.moe
    mlp = DeepseekMoE(config, tp) if moe is not None and index in moe.sparse_layers else None
    return DecoderLayer(config, backend, index, tp, mlp=mlp, attn=MLAttention(config, backend, tp))


class DeepseekModel(LlamaModel):
    """LlamaModel's forward over DeepSeek layers; the rotary covers the qk_rope_head_dim part of each head."""

    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        assert config.mla is not None
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.max_model_len, config.rope_theta,
                                      config.rope_scaling, dtype)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(deepseek_layer(config, backend, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """`tp`: this process's tensor-parallel rank; `load_weights` expects tensors already cut to its shards
    (engine/loader.py, engine/tp_shards.py)."""
    model_class = DeepseekModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= self.config.num_layers:
                continue   # DeepSeek-V3's multi-token-prediction layers
            if self._load_expert(name, tensor, missing):
                continue
            name = norm_tensor_name(name)
            if name not in params and load_norm_bias(self, name, tensor):
                continue
            module_path, _, leaf = name.rpartition(".")
            owner_path, _, module_name = module_path.rpartition(".")
            if module_name == "gate" and owner_path.endswith(".mlp"):   # the router: FusedMoE's gate / bias
                name = f"{owner_path}.experts.{'gate.weight' if leaf == 'weight' else leaf}"
            elif module_name in _GATE_UP:
                target = f"{owner_path}.gate_up_proj.{leaf}"
                module = self.get_submodule(f"{owner_path}.gate_up_proj")
                assert isinstance(module, MergedLinear)
                if isinstance(tensor, QuantizedWeight):
                    module.load_quantized(tensor, _GATE_UP[module_name])
                else:
                    module.load_shard(params[target], _GATE_UP[module_name], tensor)
                missing.discard(target)
                continue
            elif module_name in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
                attn = self.get_submodule(owner_path)
                assert isinstance(attn, MLAttention)
                tensor = attn.load_rows(module_name, tensor)
            if isinstance(tensor, QuantizedWeight):
                if module_name == "kv_b_proj":   # the backend multiplies by per-head slices: dequantized once, as vLLM
                    tensor = tensor.dequantize(params[name].dtype)
                else:
                    linear = self.get_submodule(module_path)
                    if not isinstance(linear, Linear) or name not in params:
                        raise ValueError(f"checkpoint tensor {name!r} is quantized, but "
                                         f"{self.config.architecture} has no linear layer there")
                    linear.load_quantized(tensor)
                    missing.discard(name)
                    continue
            copy_tensor(params, missing, name, tensor, self.config.architecture)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")

    def _load_expert(self, name: str, tensor: torch.Tensor, missing: set[str]) -> bool:
        """Place a routed expert's tensor (per expert or stacked); False if `name` is none."""
        per_expert, stacked = _EXPERT.match(name), _STACKED.match(name)
        if per_expert is None and stacked is None:
            return False
        prefix = (per_expert or stacked).group(1)   # type: ignore[union-attr]
        moe = self.get_submodule(prefix)
        assert isinstance(moe, FusedMoE)
        if per_expert is not None:
            expert, kind = int(per_expert.group(2)), per_expert.group(3)
            moe.load_expert(name, expert, kind.removesuffix("_proj"), tensor)
        else:
            assert stacked is not None
            for expert in range(tensor.shape[0]):
                if stacked.group(2) == "down_proj":
                    moe.load_expert(name, expert, "down", tensor[expert])
                else:
                    gate, up = tensor[expert].chunk(2, dim=0)
                    moe.load_expert(name, expert, "gate", gate)
                    moe.load_expert(name, expert, "up", up)
        missing.discard(f"{prefix}.w13")
        missing.discard(f"{prefix}.w2")
        return True


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The V2 graph; the routing differs (sigmoid scores, correction bias: `ModelConfig.moe`)."""
