"""Helpers shared by the MoE tests: a checkpoint rewritten in transformers 5's fused expert layout."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def write_fused_experts(src: str, dst: str) -> str:
    """Copy the tiny checkpoint `src` to `dst` with every MoE layer's per-expert tensors replaced by the fused
    experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I]."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    experts = config.get("num_experts") or config["num_local_experts"]
    prefixes = sorted({n.split(".experts.")[0] + ".experts" for n in tensors if ".experts.0." in n})
    for prefix in prefixes:
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([
            torch.cat((tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")))
            for e in range(experts)])
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight")
                                                      for e in range(experts)])
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
