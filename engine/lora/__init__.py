"""Multi-LoRA serving: PEFT adapters over the base model, many of them batched in one step (docs/engine.md
"Multi-LoRA"). `request` is torch-free; the other modules load and compute."""
