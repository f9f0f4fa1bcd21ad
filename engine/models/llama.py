"""Llama (MHA / GQA / MQA, llama3 and linear RoPE scaling, tied or untied embeddings).

Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral share this code: Mistral is the same graph, Qwen2 adds QKV bias
(`config.qkv_bias`), Qwen3 per-head q/k RMSNorm (`config.qk_norm`); with `config.moe` the layers it names have a
FusedMoE in place of the dense MLP (`make_mlp`)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.attention import SelfAttention
from pdcluster.engine.layers.embedding import LMHead, VocabEmbedding
from pdcluster.engine.layers.layernorm import RMSNorm, load_norm_bias, norm_tensor_name
from pdcluster.engine.layers.linear import Linear, MergedLinear
from pdcluster.engine.layers.mla import MLAttention
from pdcluster.engine.layers.mlp import GatedMLP
from pdcluster.engine.layers.moe import FusedMoE, load_moe_tensor
from pdcluster.engine.layers.rotary import RotaryEmbedding
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.quant.scheme import QuantizedWeight

# checkpoint name fragment -> (our fused module name fragment, shard)
_FUSED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], missing: set[str], name: str,
                tensor: torch.Tensor | QuantizedWeight, owner: str) -> None:
    """Checkpoint tensor `name` into `model`'s parameter (q/k/v and gate/up into their fused one's shard); a
    quantized checkpoint's weight into its linear layer."""
    name = norm_tensor_name(name)
    if not isinstance(tensor, QuantizedWeight) and name not in params and load_norm_bias(model, name, tensor):
        return
    leaf = name.split(".")[-2] if name.count(".") >= 1 else ""
    if leaf in _FUSED:
        fused, shard = _FUSED[leaf]
        target = name.replace(leaf, fused)
        module = model.get_submodule(target.rsplit(".", 1)[0])
        assert isinstance(module, MergedLinear)
        if isinstance(tensor, QuantizedWeight):
            module.load_quantized(tensor, shard)
        else:
            module.load_shard(params[target], shard, tensor)
        missing.discard(target)
        return
    if isinstance(tensor, QuantizedWeight):
        layer = model.get_submodule(name.rsplit(".", 1)[0]) if name in params else None
        if not isinstance(layer, Linear):
            raise ValueError(f"checkpoint tensor {name!r} is quantized, but {owner} has no linear layer there")
        layer.load_quantized(tensor)
        missing.discard(name)
        return
    copy_tensor(params, missing, name, tensor, owner)


def copy_tensor(params: dict[str, nn.Parameter], missing: set[str], name: str, tensor: torch.Tensor,
                owner: str) -> None:
    """Checkpoint tensor `name` into the parameter of that name, refused (naming both) if it has none or
    another shape."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
    missing.discard(name)


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, with the residual carried into the next norm. `attn` / `mlp` replace the
    default SelfAttention / GatedMLP (DeepSeek's MLA; a layer's FusedMoE)."""

    def __init__(self, config: ModelConfig, backend, index: int, tp: TPGroup, mlp: nn.Module | None = None,
                 attn: MLAttention | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: SelfAttention | MLAttention = attn if attn is not None else SelfAttention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.qkv_bias, backend,
            config.layer_window(index), tp, qk_norm_eps=config.rms_norm_eps if config.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn.layer_index = index
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, tp)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata | None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: only these rows leave the layer (they go on in that order); the MLP runs on them alone. Every
        row still writes its K/V and attends."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        if rows is not None:
            hidden, residual = hidden.index_select(0, rows), residual.index_select(0, rows)
            if not rows.numel():
                return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def make_mlp(config: ModelConfig, index: int, tp: TPGroup) -> nn.Module:
    """Layer `index`'s feed-forward block: the routed experts on the MoE config's sparse layers, else dense."""
    moe = config.moe
    if moe is not None and index in moe.sparse_layers:
        return FusedMoE(moe.num_experts, config.hidden_size, moe.intermediate_size, moe.routing(), tp,
                        moe.expert_parallel, moe.correction_bias)
    return GatedMLP(config.hidden_size, config.intermediate_size, tp)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
                                      dtype)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, i, tp, make_mlp(config, i, tp))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.capture_layers: tuple[int, ...] = ()   # EAGLE-3: the residual stream entering these layers ...
        self.captured: list[torch.Tensor] = []      # ... of the last forward, in that order

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                layer_done_callback: Callable[[int], None] | None = None,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """meta None: the compiled body (engine/compiled.py), attention reads the step context. `logit_rows`: the
        hidden states of only these rows, in that order (the last layer's MLP and the final norm skip the others,
        ~3 % of a prefill's FLOPs in a 30-layer model)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)
        residual = None
        if self.capture_layers:
            self.captured = [torch.empty(0)] * len(self.capture_layers)
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                stream = hidden if residual is None else hidden + residual
                for j, c in enumerate(self.capture_layers):
                    if c == i:
                        self.captured[j] = stream
            last = i == len(self.layers) - 1
            hidden, residual = layer(rope, hidden, residual, meta, logit_rows if last else None)
            if layer_done_callback is not None:
                layer_done_callback(i)
        if not hidden.shape[0]:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`tp`: this process's tensor-parallel rank; the parameters are its shards (engine/tp_shards.py) and
    `load_weights` expects tensors already cut to them (engine/loader.py)."""
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        tp = tp or TPGroup()
        self.model = self.model_class(config, backend, dtype, tp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                layer_done_callback: Callable[[int], None] | None = None,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, layer_done_callback, logit_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None on the tensor-parallel ranks other than 0 (`LMHead`)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[SelfAttention | MLAttention]:
        """Each layer's attention (SelfAttention; MLAttention in DeepSeek), in order."""
        return [layer.self_attn for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (already dtype/device-placed) parameters; each is cast once."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            filled = load_moe_tensor(self, name, tensor)   # routed experts' tensors, either checkpoint layout
            if filled is not None:
                missing.difference_update(filled)
                continue
            load_tensor(self, params, missing, name, tensor, self.config.architecture)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
