"""Quantized checkpoints for the tests: GPTQ and AWQ packed as their tools pack them (AutoGPTQ's
QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear), msModelSlim's W8A8_DYNAMIC export, and a whole tiny model
re-written in one of those formats next to its dequantized float reference."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import torch


def gptq_checkpoint(w: torch.Tensor, bits: int, group: int, sym: bool, v1: bool):
    """qweight/qzeros/scales/g_idx as AutoGPTQ packs them, and the float weight they stand for."""
    out_f, in_f = w.shape
    g = group if group > 0 else in_f
    maxq = (1 << bits) - 1
    wg = w.reshape(out_f, in_f // g, g)
    if sym:
        xmax = wg.abs().amax(-1)
        scale = (2 * xmax / maxq).half()
        zero = torch.full_like(xmax, (maxq + 1) // 2)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).half()
        zero = torch.round(-lo / scale.float())
    s = scale.float()
    q = torch.clamp(torch.round(wg / s[..., None]) + zero[..., None], 0, maxq).reshape(out_f, in_f)
    deq = ((q.reshape(out_f, -1, g) - zero[..., None]) * s[..., None]).reshape(out_f, in_f)
    pf = 32 // bits
    intweight = q.t().numpy().astype(np.uint32)                        # [in, out]
    qweight = np.zeros((in_f // pf, out_f), dtype=np.uint32)
    for j in range(pf):
        qweight |= intweight[j::pf] << (bits * j)
    stored = (zero.t() - (1 if v1 else 0)).numpy().astype(np.int64).astype(np.uint32)   # [groups, out]
    qzeros = np.zeros((stored.shape[0], out_f // pf), dtype=np.uint32)
    for j in range(pf):
        qzeros |= stored[:, j::pf] << (bits * j)
    tensors = {"qweight": torch.from_numpy(qweight.astype(np.int32)),
               "qzeros": torch.from_numpy(qzeros.astype(np.int32)), "scales": scale.t().contiguous(),
               "g_idx": torch.arange(in_f, dtype=torch.int32) // g}
    return tensors, deq


def awq_checkpoint(w: torch.Tensor, group: int):
    out_f, in_f = w.shape
    wg = w.reshape(out_f, in_f // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    zero = torch.clamp(-torch.round(lo / scale.float()), 0, 15)
    q = torch.clamp(torch.round(wg / scale.float()[..., None]) + zero[..., None], 0, 15)
    deq = ((q - zero[..., None]) * scale.float()[..., None]).reshape(out_f, in_f)
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(cols: np.ndarray) -> torch.Tensor:   # [rows, out] -> [rows, out / 8]
        packed = np.zeros((cols.shape[0], cols.shape[1] // 8), dtype=np.uint32)
        for c in range(cols.shape[1] // 8):
            for i in range(8):
                packed[:, c] |= cols[:, c * 8 + order[i]].astype(np.uint32) << (i * 4)
        return torch.from_numpy(packed.astype(np.int32))

    intweight = q.reshape(out_f, in_f).t().numpy().astype(np.uint32)
    tensors = {"qweight": pack(intweight), "qzeros": pack(zero.t().numpy().astype(np.uint32)),
               "scales": scale.t().contiguous()}
    return tensors, deq



def modelslim_dynamic_checkpoint(w: torch.Tensor):
    """msModelSlim's W8A8_DYNAMIC tensors of one layer (int8 per-channel symmetric weight, its scale and a zero
    offset), and the float weight they stand for."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.clamp(torch.round(w / scale), -128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}, q * scale


_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def requantize(src: str, out: str, fmt: str) -> tuple[str, str]:
    """`src` (a float checkpoint, one safetensors file) with its decoder layers' linear weights in `fmt` ("gptq":
    4-bit symmetric, groups of 32, AutoGPTQ's v1 zeros; "awq": 4-bit with zero points, groups of 32; "modelslim":
    W8A8_DYNAMIC), and the float checkpoint of what they dequantize to: (quantized dir, reference dir)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, reference, described = {}, {}, {"model_quant_type": "W8A8_DYNAMIC"}
    for name, t in tensors.items():
        if not _LINEAR.match(name):
            quantized[name] = reference[name] = t
            described[name] = "FLOAT"
            continue
        module = name.removesuffix(".weight")
        if fmt == "gptq":
            parts, deq = gptq_checkpoint(t.float(), 4, 32, True, True)
        elif fmt == "awq":
            parts, deq = awq_checkpoint(t.float(), 32)
        else:
            parts, deq = modelslim_dynamic_checkpoint(t.float())
        for role, part in parts.items():
            quantized[f"{module}.{role}"] = part
            described[f"{module}.{role}"] = "W8A8_DYNAMIC"
        reference[name] = deq
    dirs = (f"{out}-{fmt}", f"{out}-{fmt}-reference")
    for path, weights in zip(dirs, (quantized, reference), strict=True):
        shutil.copytree(src, path, ignore=shutil.ignore_patterns("*.safetensors", "pdcluster_manifest.json"))
        save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if fmt == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                         "sym": True, "checkpoint_format": "gptq"}
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                         "version": "gemm"}
    else:
        with open(os.path.join(dirs[0], "quant_model_description.json"), "w") as f:
            json.dump(described, f)
    with open(os.path.join(dirs[0], "config.json"), "w") as f:
        json.dump(config, f)
    return dirs
