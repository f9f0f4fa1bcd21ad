"""Reading a llama.cpp GGUF checkpoint as a HF one: config, tokenizer (+ chat template) and dequantized tensors.

The `gguf` package parses the file, names the tensors (`gguf.get_tensor_name_map`, the same table llama.cpp's
converter writes with) and dequantizes them; transformers builds the HF config and the fast tokenizer from the
metadata (`from_pretrained(..., gguf_file=)`). What is left here: checking the fields the engine needs (an error
names the file and the field), undoing llama.cpp's reordering of the q/k rows (Llama only) and unstacking the
experts llama.cpp stores as one [E, rows, cols] tensor per MoE projection. Torch is imported lazily.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

# GGUF `general.architecture` -> HF architecture the engine runs. llama.cpp writes Mistral and Mixtral as "llama"
# (Mixtral: with `llama.expert_count`).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}
_REQUIRED = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count")


class GGUFCheckpoint:
    """One .gguf file. Metadata is parsed on open (memory-mapped); tensors are dequantized one at a time."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: {path} does not exist (expected a .gguf file)")
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError / struct.error / IndexError on damage
            raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.arch = self.field("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"{path}: field 'general.architecture' is {self.arch!r}; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        for key in _REQUIRED:
            self.field(f"{self.arch}.{key}")
        self.num_layers = int(self.field(f"{self.arch}.block_count"))
        self.num_heads = int(self.field(f"{self.arch}.attention.head_count"))
        self.num_kv_heads = int(self.field(f"{self.arch}.attention.head_count_kv", self.num_heads))

    def field(self, key: str, default: Any = ...) -> Any:
        """A metadata value; a missing required one is a ValueError naming the file and the field."""
        entry = self.reader.fields.get(key)
        if entry is None:
            if default is ...:
                raise ValueError(f"{self.path}: field {key!r} is missing")
            return default
        return entry.contents()

    @property
    def chat_template(self) -> str | None:
        return self.field("tokenizer.chat_template", None)

    def hf_config(self) -> dict[str, Any]:
        """config.json as transformers reads this file, with `architectures` set."""
        from transformers import AutoConfig

        folder, name = os.path.split(os.path.abspath(self.path))
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
        except Exception as exc:
            raise ValueError(f"{self.path}: transformers cannot build a config from its metadata: {exc}") from exc
        # transformers reads a "llama" GGUF named like Mistral as model_type "mistral" (sliding window and all)
        mistral = self.arch == "llama" and config.get("model_type") == "mistral"
        config["architectures"] = ["MistralForCausalLM" if mistral else GGUF_ARCHITECTURES[self.arch]]
        experts = int(self.field(f"{self.arch}.expert_count", 0))
        if self.arch == "llama" and experts:   # Mixtral: every layer routed, top-k renormalized, no window
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                          num_experts_per_tok=int(self.field("llama.expert_used_count")), sliding_window=None)
        config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in self.reader.tensors)
        if self.arch in ("qwen3", "qwen3moe"):   # fields transformers' GGUF table leaves out
            default = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            config["head_dim"] = int(self.field(f"{self.arch}.attention.key_length", default))
        if self.arch == "qwen3moe":   # llama.cpp routes every layer, renormalizing the top-k (norm_topk_prob)
            config["moe_intermediate_size"] = int(self.field(f"{self.arch}.expert_feed_forward_length"))
            config.update(num_experts=int(self.field(f"{self.arch}.expert_count")), norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])
        return config

    def hf_tokenizer(self):
        """The fast tokenizer transformers converts from the metadata, chat template included."""
        from transformers import AutoTokenizer

        if "tokenizer.ggml.tokens" not in self.reader.fields:
            raise ValueError(f"{self.path}: field 'tokenizer.ggml.tokens' is missing (no tokenizer in the file)")
        folder, name = os.path.split(os.path.abspath(self.path))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if getattr(tok, "chat_template", None) is None and self.chat_template:
            tok.chat_template = self.chat_template
        return tok

    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def iter_tensors(self) -> Iterator[tuple[str, Any]]:
        """(HF name, float32 torch tensor) for every tensor, dequantized, q/k rows in HF order."""
        import torch
        from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map

        arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == self.arch)
        names = get_tensor_name_map(arch, self.num_layers)
        mixtral = self.arch == "llama" and bool(self.field("llama.expert_count", 0))
        for tensor in self.reader.tensors:
            base, _, suffix = tensor.name.rpartition(".")
            hf = _hf_name(names, base, self.num_layers)
            if hf is None:
                raise ValueError(f"{self.path}: tensor {tensor.name!r} has no HF counterpart in {self.arch}")
            weights = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            if self.arch == "llama" and base.endswith(".attn_q"):  # only llama.cpp's Llama converter permutes
                weights = unpermute_rope_rows(weights, self.num_heads)
            elif self.arch == "llama" and base.endswith(".attn_k"):
                weights = unpermute_rope_rows(weights, self.num_kv_heads)
            if mixtral:   # Mixtral's HF names: block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 / w3 / w2
                hf = hf.replace(".mlp.", ".block_sparse_moe.")
            if hf.endswith(_STACKED_EXPERTS):   # [E, rows, cols]: the per-expert tensors of a HF checkpoint
                block, _, proj = hf.rpartition(".")
                proj = _MIXTRAL_EXPERT.get(proj, proj) if mixtral else proj
                for e in range(weights.shape[0]):
                    yield f"{block}.{e}.{proj}.{suffix}", weights[e]
                continue
            yield f"{hf}.{suffix}", weights


def unpermute_rope_rows(weight, num_heads: int):
    """llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout to interleaved pairs
    (`permute` in convert_hf_to_gguf.py); this is the inverse (rows of a head: evens first, then odds)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


_HF_TEMPLATES = ("model.embed_tokens", "model.norm", "lm_head", "model.layers.{i}.input_layernorm",
                 "model.layers.{i}.post_attention_layernorm", "model.layers.{i}.self_attn.q_proj",
                 "model.layers.{i}.self_attn.k_proj", "model.layers.{i}.self_attn.v_proj",
                 "model.layers.{i}.self_attn.o_proj", "model.layers.{i}.mlp.gate_proj",
                 "model.layers.{i}.mlp.up_proj", "model.layers.{i}.mlp.down_proj",
                 "model.layers.{i}.self_attn.q_norm", "model.layers.{i}.self_attn.k_norm", "model.layers.{i}.mlp.gate",
                 "model.layers.{i}.mlp.experts.gate_proj", "model.layers.{i}.mlp.experts.up_proj",
                 "model.layers.{i}.mlp.experts.down_proj")
_STACKED_EXPERTS = (".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _hf_name(names, gguf_base: str, num_layers: int) -> str | None:
    """The HF module name that `gguf`'s name table maps to this GGUF tensor base name."""
    layer = gguf_base.split(".")[1] if gguf_base.startswith("blk.") else None
    for template in _HF_TEMPLATES:
        hf = template.format(i=layer) if layer is not None else template
        if "{i}" in template and layer is None:
            continue
        if names.get_name(hf) == gguf_base:
            return hf
    return None
