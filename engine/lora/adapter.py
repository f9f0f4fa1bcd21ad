"""A PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) read, checked against the base model
and cut to one tensor-parallel rank's part.

Each target module's delta is B @ A * scaling (scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA);
the scaling is folded into B here, so the batched compute (engine/lora/layers.py) multiplies by 0/1 only.
What we cannot serve is refused naming the field or tensor: DoRA, trained biases, modules_to_save, per-module
rank/alpha patterns, targets outside attention q/k/v/o and the MLP's gate/up/down, ranks over max_lora_rank,
shapes that do not fit the base model."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.tp_shards import ROW, shard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT target module -> the decoder-layer block it sits in
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit before .weight)
_TENSOR = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<module>\w+)\.lora_(?P<ab>[AB])"
                     r"(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    content_hash: str   # of the weights file and the config fields that change the delta
    # (layer index, PEFT module) -> (A [r, in], B [out, r] * scaling): this rank's part, fp32 on CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of the whole (unsharded) model."""
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def read_config(path: str, name: str, max_lora_rank: int) -> tuple[int, float, dict]:
    """(rank, scaling, the config) of the adapter at `path`, or ValueError naming what we cannot serve."""
    where = f"LoRA adapter {name!r} ({path})"
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = {"use_dora": "DoRA adapters are not supported", "modules_to_save": "modules_to_save (full trained "
               "copies of base modules) is not supported", "rank_pattern": "per-module ranks are not supported",
               "alpha_pattern": "per-module alphas are not supported", "fan_in_fan_out": "fan_in_fan_out "
               "(Conv1D layouts) is not supported", "layer_replication": "layer_replication is not supported"}
    for key, why in refused.items():
        if cfg.get(key):
            raise ValueError(f"{where}: {key} = {cfg[key]!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias = {cfg['bias']!r}: trained biases are not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r = {r!r} is not a positive integer")
    if r > max_lora_rank:
        raise ValueError(f"{where}: r = {r} exceeds max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha = {alpha!r} is not a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} cannot be served (supported: {', '.join(TARGETS)})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, scaling, cfg


def load_adapter(name: str, path: str, config: ModelConfig, max_lora_rank: int, rank: int = 0,
                 tp: int = 1) -> LoRAAdapter:
    """Read and check the adapter at `path`; its weights cut to tensor-parallel `rank`'s part: B by output rows
    for the column-parallel q/k/v/gate/up (as their weights), A by input columns for the row-parallel o/down."""
    r, scaling, cfg = read_config(path, name, max_lora_rank)
    where = f"LoRA adapter {name!r} ({path})"
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        found = "adapter_model.bin (pickle) is not read; save with safe_serialization" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else "missing"
        raise ValueError(f"{where}: {WEIGHTS_FILE} {found}")
    with open(weights_path, "rb") as f:
        data = f.read()
    try:
        tensors = load_safetensors(data)
    except Exception as exc:   # safetensors raises its own error types on a corrupt file
        raise ValueError(f"{where}: {WEIGHTS_FILE} is corrupt ({exc})") from None
    digest = hashlib.blake2b(data, digest_size=16)
    digest.update(json.dumps([r, scaling, bool(cfg.get("use_rslora"))]).encode())
    shapes = module_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):
        m = _TENSOR.search(key)
        if m is None or m["module"] not in TARGETS or TARGETS[m["module"]] != m["block"]:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a supported target "
                             f"({', '.join(TARGETS)})")
        layer, module = int(m["layer"]), m["module"]
        if layer >= config.num_layers:
            raise ValueError(f"{where}: tensor {key!r}: the base model has {config.num_layers} layers")
        n_in, n_out = shapes[module]
        want = (r, n_in) if m["ab"] == "A" else (n_out, r)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {want} "
                             f"(rank {r}, {module} of the base model)")
        parts.setdefault((layer, module), {})[m["ab"]] = tensor
    if not parts:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(name, path, r, scaling, digest.hexdigest())
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layers.{layer}.{module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float() * scaling
        weight_name = f"model.layers.{layer}.{TARGETS[module]}.{module}.weight"
        if module in ROW:
            a = shard(weight_name, a, config, rank, tp)
        else:
            b = shard(weight_name, b, config, rank, tp)
        adapter.weights[(layer, module)] = (a.contiguous(), b.contiguous())
    return adapter
