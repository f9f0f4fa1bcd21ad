"""Writing a tiny HF checkpoint (engine.testing.make_tiny_model) as a llama.cpp GGUF file, the way llama.cpp's
convert_hf_to_gguf.py lays it out: metadata under the GGUF architecture name, tensors named by `gguf`'s own
table, each MoE layer's experts stacked into one [E, rows, cols] tensor per projection, a gpt2-style BPE
tokenizer. "llama" (written for a Mixtral checkpoint here) gets llama.cpp's q/k row permutation, as its
converter's LlamaModel applies it."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def write_gguf(hf_dir: str, path: str, arch: str) -> str:
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    layers = cfg["num_hidden_layers"]
    writer = GGUFWriter(path, arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_block_count(layers)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if arch in ("qwen3moe", "llama") and (cfg.get("num_experts") or cfg.get("num_local_experts")):
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_tokenizer(writer, hf_dir, cfg)

    gguf_arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(gguf_arch, layers)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match:   # llama.cpp stacks a layer's experts: mlp.experts.gate_proj [E, I, H] and so on
            stacks.setdefault(f"{match[1]}.experts.{match[3]}", {})[int(match[2])] = tensor
            continue
        base, _, suffix = name.rpartition(".")
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg["num_attention_heads"] if base.endswith("q_proj") else cfg["num_key_value_heads"]
            tensor = permute_rope_rows(tensor, heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    for base, experts in stacks.items():
        stacked = torch.stack([experts[e] for e in sorted(experts)])
        writer.add_tensor(f"{names.get_name(base)}.weight", stacked.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's `permute` (convert_hf_to_gguf.py LlamaModel): each head's rotate-half rows to interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _add_tokenizer(writer, hf_dir: str, cfg: dict) -> None:
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])   # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg.get("pad_token_id") or 0)

