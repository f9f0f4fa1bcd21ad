"""Loading a HF model directory: config, safetensors weights (single or sharded), tokenizer, EOS ids."""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.models import get_model_class
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.quant.scheme import QuantizedWeight
from pdcluster.engine.tp_shards import VOCAB, expert_parallel, holds, rank_file, shard, shard_parts

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def checkpoint_files(model_dir: str, rank: int = 0, tp: int = 1) -> list[str]:
    """The files rank `rank` of `tp` reads: its own file of a pre-sharded conversion (engine/convert.py), else
    every file of the checkpoint (the rank then reads only its slices of them)."""
    converted = _converted_tp(model_dir)
    if converted > 1:
        if converted != tp:
            raise ValueError(f"model: {model_dir} is converted for tensor_parallel_size={converted} (one file per "
                             f"rank); this engine runs tensor_parallel_size={tp}: convert with "
                             f"--tensor-parallel-size {tp} (or 1, which every tensor_parallel_size can read)")
        path = os.path.join(model_dir, rank_file(rank, tp))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: {path} (rank {rank}'s shard) is missing")
        return [path]
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(model_dir, s) for s in shards]
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"model: shard {p} named in {_INDEX} is missing")
        return paths
    single = os.path.join(model_dir, _SINGLE)
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(model_dir, f) for f in others]
    raise FileNotFoundError(f"model: no weights in {model_dir} (expected {_SINGLE} or {_INDEX} with its shards)")


FINGERPRINT_SAMPLE = 64 << 10   # bytes read at the start, middle and end of each weight file


def checkpoint_fingerprint(model_dir: str) -> str:
    """What tells this checkpoint's weights from another's without reading them all: blake2b over config.json and,
    per weight file (every rank's of a pre-sharded conversion), its name, size and three 64 KiB samples. Two
    fine-tunes of one base differ in every sample; the same checkpoint copied to another host gives the same value."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest.update(f.read())
    converted = _converted_tp(model_dir)
    files = [os.path.join(model_dir, rank_file(r, converted)) for r in range(converted)] if converted > 1 \
        else checkpoint_files(model_dir)
    for path in files:
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for at in sorted({0, max(0, size // 2 - FINGERPRINT_SAMPLE // 2), max(0, size - FINGERPRINT_SAMPLE)}):
                f.seek(at)
                digest.update(f.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()


def _converted_tp(model_dir: str) -> int:
    """tensor_parallel_size a `pdcluster convert` output was sharded for (1 for any other directory)."""
    path = os.path.join(model_dir, "pdcluster_manifest.json")
    if not os.path.isfile(path):
        return 1
    try:
        with open(path) as f:
            return int(json.load(f).get("tensor_parallel_size", 1))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a valid manifest ({exc})") from exc


def _check_converted_expert_parallel(model_dir: str, config: ModelConfig) -> None:
    """A pre-sharded MoE conversion holds either slices of every expert or whole experts per rank: refuse the
    other mode rather than load wrong shapes."""
    with open(os.path.join(model_dir, "pdcluster_manifest.json")) as f:
        converted = bool(json.load(f).get("expert_parallel", False))
    wanted = expert_parallel(config)
    if config.moe is not None and converted != wanted:
        raise ValueError(f"model: {model_dir} is converted {'with' if converted else 'without'} expert parallelism; "
                         f"this engine runs enable_expert_parallel={wanted}: convert with "
                         f"--{'' if wanted else 'no-'}enable-expert-parallel (or tensor_parallel_size 1)")


def iter_weights(model_dir: str, config: ModelConfig | None = None,
                 tp: TPGroup | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors straight from memory-mapped safetensors files; under tensor parallelism (`tp`, `config`), only
    this rank's slice of each (read as a slice: the rest of the tensor is never read), and under expert
    parallelism only this rank's experts (the others' tensors are skipped unread). A quantized layer's tensors
    come whole (packed along either dimension): `assemble_quantized` cuts the rank's part once they are unpacked."""
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    presharded = _converted_tp(model_dir) > 1
    if presharded and config is not None:
        _check_converted_expert_parallel(model_dir, config)
    for path in checkpoint_files(model_dir, rank, size):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if size == 1 or presharded:
                    yield name, f.get_tensor(name)
                    continue
                if config is None:
                    raise ValueError("iter_weights: slicing the weights for tensor parallelism needs `config`")
                if not holds(name, config, rank, size):   # another expert-parallel rank's expert
                    continue
                if config.quantization is not None and config.quantization.split_name(name) is not None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                cuts = shard_parts(name, shape, config, rank, size)
                if cuts is None:
                    yield name, part[:]
                    continue
                pieces = []
                for dim, start, length in cuts:
                    index = [slice(None)] * len(shape)
                    index[dim] = slice(start, start + length)
                    pieces.append(part[tuple(index)])
                yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cuts[0][0])


def read_tensors(model_dir: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors whose names `wanted` accepts, whole, reading no others. Of a pre-sharded conversion:
    the embedding and LM head concatenated over the rank files (they are cut by vocabulary rows), anything else as
    rank 0's file holds it (its shard; whole what only rank 0 reads: DeepSeek's MTP layers)."""
    converted = _converted_tp(model_dir)
    files = checkpoint_files(model_dir, 0, converted)
    others = [checkpoint_files(model_dir, r, converted)[0] for r in range(1, converted)]
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if not wanted(name):
                    continue
                tensor = f.get_tensor(name)
                if others and name.rsplit(".", 2)[-2] in VOCAB:   # (not the MTP layers' copies: rank 0's only)
                    parts = [tensor]
                    for other in others:
                        with safe_open(other, framework="pt", device="cpu") as g:
                            if name in g.keys():
                                parts.append(g.get_tensor(name))
                    tensor = torch.cat(parts)
                yield name, tensor


def assemble_quantized(weights: Iterable[tuple[str, torch.Tensor]], quant, config: ModelConfig | None = None,
                       tp: TPGroup | None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A quantized checkpoint's tensors with each quantized layer's tensors (qweight, scales, ...) gathered into
    one `QuantizedWeight`, yielded as `<layer>.weight` once all it needs arrived (and the float bias a format
    folds into its own tensors as `<layer>.bias`); other tensors as they are. A layer's optional tensors that
    come after it was assembled are redundant by the format's definition and dropped. Under tensor parallelism
    (`tp`, `config`) each quantized weight is cut to this rank's part as its float weight would be."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        split = quant.split_name(name)
        if split is None:
            yield name, tensor
            continue
        module, role = split
        if module in done:
            if role in quant.optional_roles(module):
                continue
            raise ValueError(f"quantized checkpoint: tensor {name!r} of layer {module} comes twice")
        parts = pending.setdefault(module, {})
        parts[role] = tensor
        if quant.roles(module) <= parts.keys():
            parts = pending.pop(module)
            done.add(module)
            weight = quant.assemble(module, parts)
            weight.scheme = quant.scheme_for(module)
            bias = quant.bias(module, parts)
            if tp is not None and tp.size > 1:
                assert config is not None
                weight = _rank_part(f"{module}.weight", weight, config, tp)
                bias = None if bias is None else shard(f"{module}.bias", bias, config, tp.rank, tp.size)
            yield f"{module}.weight", weight
            if bias is not None:
                yield f"{module}.bias", bias
    for module, parts in pending.items():
        raise ValueError(f"quantized checkpoint: layer {module} lacks {sorted(quant.roles(module) - parts.keys())}")


def _rank_part(name: str, weight: QuantizedWeight, config: ModelConfig, tp: TPGroup) -> QuantizedWeight:
    """This rank's rows (column-parallel) or inputs (row-parallel) of a quantized weight, with their scales."""
    cuts = shard_parts(name, tuple(weight.qweight.shape), config, tp.rank, tp.size)
    if cuts is None:
        return weight
    (dim, start, size), = cuts
    q = weight.qweight.narrow(dim, start, size)
    scales, zeros = weight.scales, weight.zeros
    if dim == 0:
        scales = scales.narrow(0, start, size)
        zeros = None if zeros is None else zeros.narrow(0, start, size)
    elif scales.shape[1] > 1:   # groups of inputs: the rank's inputs must be whole groups
        g = weight.group_size
        if start % g or size % g:
            raise ValueError(f"quantized checkpoint: {name} has groups of {g} inputs, which do not split over "
                             f"tensor_parallel_size {tp.size} ({size} inputs per rank)")
        scales = scales.narrow(1, start // g, size // g)
        zeros = None if zeros is None else zeros.narrow(1, start // g, size // g)
    return QuantizedWeight(q.contiguous(), scales.contiguous(), None if zeros is None else zeros.contiguous(),
                           weight.input_scale, weight.input_offset, weight.scheme)


def check_quantized(config: ModelConfig, weight_pool) -> None:
    """What a quantized checkpoint cannot be served with (yet): refused naming it."""
    if config.quantization is None:
        return
    method = config.quantization.method
    if weight_pool is not None:
        raise ValueError(f"quantization ({method}): weight_pool (shared weights) is not supported")


def load_model(model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device, backend,
               weight_pool=None, tp: TPGroup | None = None):
    """`weight_pool` (a `SharedWeightPool`, CPU only): the parameters become read-only views of the pool's copy
    (engine/weight_pool.py), loaded from the checkpoint only if the pool has none yet, and never prepacked.
    `tp`: this process's tensor-parallel rank; it loads only its shards."""
    tp = tp or TPGroup()
    if weight_pool is not None and device.type != "cpu":
        raise ValueError(f"weight_pool: shared weights are CPU-only for now (device is {device.type})")
    if weight_pool is not None and tp.size > 1:
        raise ValueError("weight_pool: not supported with tensor_parallel_size > 1 (each rank holds other shards)")
    files = checkpoint_files(model_dir, tp.rank, tp.size)  # fail on missing weights before allocating anything
    del files
    check_quantized(config, weight_pool)
    cls = get_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, backend, dtype, tp)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        if weight_pool is not None:
            weight_pool.load(model, model_dir, dtype, lambda: model.load_weights(iter_weights(model_dir)))
            return model.eval().requires_grad_(False)
        raw = iter_weights(model_dir, config, tp)
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]] = raw if config.quantization is None \
            else assemble_quantized(raw, config.quantization, config, tp)
        model.load_weights(weights)
        for module in model.modules():   # weights are final now: device-specific packed copies
            if hasattr(module, "prepack"):
                module.prepack()
    return model.eval().requires_grad_(False)


def load_tokenizer(model_dir: str):
    """HF tokenizer from tokenizer.json / tokenizer_config.json; the chat template may sit in chat_template.jinja."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in names):
        raise FileNotFoundError(f"model: no tokenizer in {model_dir} "
                                "(expected tokenizer.json and tokenizer_config.json)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    template = os.path.join(model_dir, "chat_template.jinja")
    if getattr(tok, "chat_template", None) is None and os.path.isfile(template):
        with open(template) as f:
            tok.chat_template = f.read()
    return tok


def load_eos_token_ids(model_dir: str, config: ModelConfig, tokenizer=None) -> list[int]:
    """EOS ids: generation_config.json first, then config.json, then the tokenizer."""
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    if config.eos_token_ids:
        return list(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
