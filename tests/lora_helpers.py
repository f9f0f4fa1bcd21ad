"""PEFT adapters for the LoRA tests, and their transformers reference (the base model with the adapter merged)."""

from __future__ import annotations

import torch

from pdcluster.engine.testing import load_hf_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, out_dir: str, r: int, alpha: float, targets: list[str], seed: int,
                 rslora: bool = False, scale: float = 0.1, **extra) -> str:
    """A PEFT LoRA adapter of the model at `base_dir` with random A and B (PEFT starts B at zero), saved by
    PEFT itself (adapter_config.json + adapter_model.safetensors). `extra`: more LoraConfig fields."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf_model(base_dir), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                               use_rslora=rslora, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def merged_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                  max_new_tokens: int) -> list[list[int]]:
    """transformers greedy output of the base model with the adapter merged by PEFT (`merge_and_unload`); the
    base model alone for None."""
    from peft import PeftModel

    model = load_hf_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(out[0, len(p):].tolist())
    return outs
