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
    """Write a deterministic random `arch` checkpoint (llama | qwen2 | mistral) and tokenizer to `path`.

    `overrides` go into the HF config (e.g. num_key_value_heads=1, rope_scaling={...}, hidden_size=1024).
    `max_shard_size` (e.g. "100KB") writes sharded safetensors with an index."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    os.makedirs(path, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
