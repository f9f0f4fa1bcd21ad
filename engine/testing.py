"""Tiny deterministic random HF checkpoints + a tokenizer, for tests, the demo and benchmarks, and the
teacher-forced logits of an engine.

`make_tiny_model(path, arch="llama", **overrides)` writes config.json, safetensors weights,
generation_config.json, tokenizer.json and tokenizer_config.json (with a chat template) into `path`
and returns it. Same arguments, same bytes: weights come from a fixed seed. `prefill_logits(engine, ids)`:
the logits at every position of a prompt, computed through the engine's model and KV pool.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from pdcluster.control.sampling_params import SamplingParams

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in fixed-size "
    "blocks. Prefill is compute bound and decode is memory bound, so a disaggregated cluster runs them "
    "on different nodes. Hello world! How are you today? I am a tiny language model made of random "
    "numbers. Once upon a time there was a cluster of machines that served tokens to many users. "
    "0123456789 + - * / = ( ) [ ] { } < > , ; : ' \" ? ! user assistant system"
)

_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", num_attention_heads=4,
                    num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None),
    # head_dim 24 is not hidden / heads; Qwen3 ties its small models' embeddings
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    # layer 0 dense (mlp_only_layers), layer 1 routed: 8 experts, top-2, renormalized
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[0]),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=None),
    # MLA with odd head dims (nope 12, rope 6, v 10; latent 24 + 6), q LoRA 40, YaRN with DeepSeek's mscale
    # (mscale != mscale_all_dim: both the rotary factor and the softmax correction count); layer 0 dense,
    # layer 1 MoE: 8 experts in 4 groups, the best 2 groups, top-2, plus 2 shared experts
    "deepseek_v2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_attention_heads=4,
                        num_key_value_heads=4, tie_word_embeddings=False, q_lora_rank=40, kv_lora_rank=24,
                        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                        norm_topk_prob=False,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.707,
                                             beta_fast=32, beta_slow=1)),
    # V2-Lite's shape: no q LoRA (q_proj), greedy softmax top-k, plain RoPE
    "deepseek_v2_lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                             q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=6,
                             v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                             norm_topk_prob=False),
    # V3: sigmoid routing with e_score_correction_bias (random in make_tiny_model), 4 groups keep 2, top-2,
    # renormalized, x2.5; one shared expert; interleaved rope; YaRN
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_attention_heads=4,
                        num_key_value_heads=4, tie_word_embeddings=False, q_lora_rank=40, kv_lora_rank=24,
                        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_interleave=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.8,
                                             beta_fast=32, beta_slow=1)),
}


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained on a fixed text; deterministic. Returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str = "llama", **overrides):
    """The transformers config object for a tiny model (hidden 64, 2 layers, vocab 512, 512 positions)."""
    from transformers import AutoConfig

    if arch not in _BASE:
        raise ValueError(f"arch must be one of {sorted(_BASE)}, got {arch!r}")
    values: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
                                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, initializer_range=0.1)
    values.update(_BASE[arch])
    values.update(overrides)
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def make_tiny_model(path: str, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                    tokenizer_vocab_size: int = 400, chat_template_file: bool = False, **overrides) -> str:
    """Write a deterministic random `arch` checkpoint (one of `_BASE`) and tokenizer to `path`.

    `overrides` go into the HF config (e.g. num_key_value_heads=1, rope_scaling={...}, hidden_size=1024).
    `max_shard_size` (e.g. "100KB") writes sharded safetensors with an index."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    os.makedirs(path, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # buffers that initialize to zeros yet steer the model: random, so tests see them
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's routing correction
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    # Larger-than-default init gives well-separated logits, so greedy argmax is numerically robust.
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(path)
    tok = build_tokenizer(min(tokenizer_vocab_size, config.vocab_size))
    tok.save_pretrained(path)
    if chat_template_file:
        cfg_path = os.path.join(path, "tokenizer_config.json")
        with open(cfg_path) as f:
            tok_cfg = json.load(f)
        tok_cfg.pop("chat_template", None)
        with open(cfg_path, "w") as f:
            json.dump(tok_cfg, f, indent=2)
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
    return path


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    """The transformers reference model for a checkpoint directory (eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def prefill_logits(engine, token_ids: list[int], block_table: list[int] | None = None) -> torch.Tensor:
    """fp32 logits at every position of `token_ids`, computed from scratch (on every tensor-parallel rank) into
    `block_table`, or into blocks taken from the engine's allocator for the call. The engine must be idle."""
    from pdcluster.engine.scheduler import ScheduledBatch
    from pdcluster.engine.sequence import Sequence

    seq = Sequence("_logits", token_ids, SamplingParams(max_tokens=1), [], len(token_ids) + 1, 0)
    bm = engine.scheduler.block_manager if block_table is None else None
    if bm is not None and not bm.allocate(seq, len(token_ids)):
        raise ValueError(f"prefill_logits: no room for {len(token_ids)} tokens in the KV pool")
    if block_table is not None:
        seq.block_table = list(block_table)
    try:
        inputs, _ = engine.runner.prepare(ScheduledBatch([seq], [len(token_ids)]))
        inputs.sample_rows = list(range(len(token_ids)))
        return engine.runner.execute_all_ranks(inputs).float()
    finally:
        if bm is not None:
            bm.free(seq)


def make_eagle_head(path: str, target_dir: str, method: str = "eagle", seed: int = 0, num_layers: int = 1,
                    fc_bias: bool = False, draft_vocab_size: int | None = None,
                    aux_layers: list[int] | None = None, echo: bool = False) -> str:
    """Write a random EAGLE (`eagle`) or EAGLE-3 (`eagle3`) head for the model at `target_dir`, in the
    checkpoint layout of the published heads: no embedding or (EAGLE) LM head of its own, EAGLE's first layer
    without an input norm; EAGLE-3's `midlayer` over 2 x hidden, `hidden_norm`, a final norm, an LM head over
    `draft_vocab_size` of the target's ids (a random subset, `d2t` offsets) and `t2d`.

    `echo` (EAGLE): a head whose output is its input feature (fc picks it, the layers add nothing), so it drafts
    the token the target predicted last, again: right wherever the target repeats a token, which exercises
    accepted drafts."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, h // 4, 2 * h
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def layer(prefix: str, in_dim: int, input_norm: bool) -> dict[str, torch.Tensor]:
        t = {f"{prefix}self_attn.q_proj.weight": rnd(heads * head_dim, in_dim),
             f"{prefix}self_attn.k_proj.weight": rnd(kv_heads * head_dim, in_dim),
             f"{prefix}self_attn.v_proj.weight": rnd(kv_heads * head_dim, in_dim),
             f"{prefix}self_attn.o_proj.weight": rnd(h, heads * head_dim),
             f"{prefix}post_attention_layernorm.weight": 1 + rnd(h),
             f"{prefix}mlp.gate_proj.weight": rnd(inter, h), f"{prefix}mlp.up_proj.weight": rnd(inter, h),
             f"{prefix}mlp.down_proj.weight": rnd(h, inter)}
        if input_norm:
            t[f"{prefix}input_layernorm.weight"] = 1 + rnd(h)
        return t

    config: dict[str, Any] = dict(
        model_type="llama", hidden_size=h, intermediate_size=inter, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=target.get("max_position_embeddings", 512))
    tensors: dict[str, torch.Tensor] = {}
    if method == "eagle":
        config["architectures"] = ["LlamaForCausalLMEagle"]
        tensors["fc.weight"] = rnd(h, 2 * h)
        if fc_bias:
            tensors["fc.bias"] = rnd(h)
        for i in range(num_layers):
            tensors.update(layer(f"layers.{i}.", h, input_norm=i > 0))
            if echo:
                tensors[f"layers.{i}.self_attn.o_proj.weight"].zero_()
                tensors[f"layers.{i}.mlp.down_proj.weight"].zero_()
        if echo:
            tensors["fc.weight"] = torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1)
            tensors.pop("fc.bias", None)
    elif method == "eagle3":
        dv = draft_vocab_size or vocab
        ids = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv, num_hidden_layers=1,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers} if aux_layers else {})
        tensors.update({"fc.weight": rnd(h, 3 * h), "midlayer.hidden_norm.weight": 1 + rnd(h),
                        "norm.weight": 1 + rnd(h), "lm_head.weight": rnd(dv, h, scale=0.3),
                        "d2t": ids - torch.arange(dv),
                        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)})
        tensors.update(layer("midlayer.", 2 * h, input_norm=True))
    else:
        raise ValueError(f"method must be eagle or eagle3, got {method!r}")
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def add_mtp_layer(model_dir: str, seed: int = 0, echo: bool = False) -> str:
    """Turn a tiny DeepSeek-V3 checkpoint of L + 1 layers into one of L layers with a multi-token-prediction
    layer (layer L, as DeepSeek-V3 ships it: enorm, hnorm, eh_proj, shared_head, a copy of the embedding).
    `echo`: the layer drafts the token the target predicted last again (see `make_eagle_head`)."""
    from safetensors.torch import load_file, save_file

    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    last = cfg["num_hidden_layers"] - 1
    cfg.update(num_hidden_layers=last, num_nextn_predict_layers=1)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{last}."
    tensors.update({f"{p}enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    f"{p}hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    f"{p}eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
                    f"{p}shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    f"{p}shared_head.head.weight": 0.3 * torch.randn(vocab, h, generator=g),
                    f"{p}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    if echo:   # eh_proj picks hnorm(feature); attention and MLP add nothing; the target's own LM head
        tensors.update({f"{p}hnorm.weight": torch.ones(h), f"{p}shared_head.norm.weight": torch.ones(h),
                        f"{p}eh_proj.weight": torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1),
                        f"{p}shared_head.head.weight": tensors["lm_head.weight"].clone()})
        for name, t in tensors.items():
            if name.startswith(p) and name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir
