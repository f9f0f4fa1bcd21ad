"""Draft heads over the target's hidden states, in the checkpoint layouts vLLM reads:

- EAGLE (`eagle`): `fc` over [embedding of the next token, target's last hidden state] (2H -> H), Llama decoder
  layers whose first has no input norm, the sum of hidden and residual as the next feature, logits from the
  target's LM head (no final norm).
- EAGLE-3 (`eagle3`): `fc` over the residual stream entering three target layers (3H -> H, applied to target
  features only), one `midlayer` whose attention reads [normed embedding, normed feature] (2H), a final norm,
  an LM head over a draft vocabulary mapped to the target's ids by `d2t` (offsets), the pre-norm hidden state as
  the next feature.
- DeepSeek MTP (`mtp`): layer `num_hidden_layers` of the model's own checkpoint: `eh_proj` over [enorm(embedding),
  hnorm(target's last hidden state)], one DeepSeek decoder layer (MLA, MoE or dense), `shared_head` norm and LM
  head; the embedding at position 0 is zero (vLLM's masking).

Each head maps (next-token ids, positions, features) to the features of the next draft step, and those to greedy
draft tokens in the target's vocabulary. A feature from the target is what `ModelRunner` captured
(`capture_layers` for EAGLE-3); from the head's own previous step, what `forward` returned.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.attention import SelfAttention
from pdcluster.engine.layers.embedding import LMHead, VocabEmbedding
from pdcluster.engine.layers.layernorm import RMSNorm
from pdcluster.engine.layers.linear import Linear, MergedLinear
from pdcluster.engine.layers.rotary import RotaryEmbedding
from pdcluster.engine.models.deepseek import DeepseekV2ForCausalLM
from pdcluster.engine.models.llama import DecoderLayer
from pdcluster.engine.parallel import TPGroup


class EagleHead(nn.Module):
    """EAGLE: `config` is the head's own (num_hidden_layers decoder layers). `fc_bias`: the checkpoint's fc has
    a bias (SafeAILab's layout)."""
    feature_size_factor = 1

    def __init__(self, config: ModelConfig, backend, fc_bias: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.rotary = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
                                      torch.get_default_dtype())
        self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.fc = Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, i, TPGroup()) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = LMHead(config.vocab_size, h)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                from_target: bool) -> torch.Tensor:
        hidden = self.fc(torch.cat((self.embed_tokens(ids), features), dim=-1))
        rope = self.rotary.lookup(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        assert residual is not None
        return hidden + residual

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(out)
        assert logits is not None
        return logits.argmax(dim=-1)

    def attention_layers(self) -> list:
        return [layer.self_attn for layer in self.layers]


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding), hidden_norm(feature)], the feature (or, with
    `norm_before_residual`, its norm) as the residual."""

    def __init__(self, config: ModelConfig, backend, norm_before_residual: bool) -> None:
        super().__init__(config, backend, 0, TPGroup())
        attn = self.self_attn
        assert isinstance(attn, SelfAttention)
        attn.qkv_proj = MergedLinear(2 * config.hidden_size,
                                     {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}, bias=config.qkv_bias)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, rope, embeds: torch.Tensor, feature: torch.Tensor,  # type: ignore[override]
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        hidden = self.self_attn(rope, torch.cat((self.input_layernorm(embeds), normed), dim=-1), meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Eagle3Head(nn.Module):
    def __init__(self, config: ModelConfig, backend, target_hidden_size: int, draft_vocab_size: int,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.rotary = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
                                      torch.get_default_dtype())
        self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.fc = Linear(3 * target_hidden_size, h)
        self.midlayer = Eagle3Layer(config, backend, norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = LMHead(draft_vocab_size, h)
        self.d2t: torch.Tensor   # draft id -> target id - draft id
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                from_target: bool) -> torch.Tensor:
        feature = self.fc(features) if from_target else features
        hidden, residual = self.midlayer(self.rotary.lookup(positions), self.embed_tokens(ids), feature, meta)
        return hidden + residual   # pre-norm: the next step's feature

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(out))
        assert logits is not None
        best = logits.argmax(dim=-1)
        return best + self.d2t[best]

    def attention_layers(self) -> list:
        return [self.midlayer.self_attn]


class MTPHead(DeepseekV2ForCausalLM):
    """DeepSeek's multi-token-prediction layer as a one-layer DeepSeek model (`config.num_layers` 1; `model.norm`
    is shared_head.norm, `lm_head` shared_head.head) plus enorm, hnorm and eh_proj."""

    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype) -> None:
        super().__init__(config, backend, dtype, TPGroup())
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,  # type: ignore[override]
                meta: AttentionMetadata, from_target: bool) -> torch.Tensor:
        embeds = self.model.embed_tokens(ids).masked_fill((positions == 0)[:, None], 0.0)
        hidden = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(features)), dim=-1))
        hidden, residual = self.model.layers[0](self.model.rotary.lookup(positions), hidden, None, meta)
        return hidden + residual

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(out))
        assert logits is not None
        return logits.argmax(dim=-1)

