"""Multi-LoRA decode step: the time of one engine decode step of B sequences when they use 0 (the base model
alone), 1, 4 or 8 distinct LoRA adapters (rank 16 on every target: q/k/v/o/gate/up/down), interleaved round by
round in one process so every variant sees the same machine load (issue #33's speed item).

Each variant is an LLMEngine on the same model (the LoRA ones with enable_lora, max_loras 8, max_lora_rank 16)
with B requests of a P-token prompt spread over its adapters; once every request decodes, each round runs
`--steps` engine steps per variant (ms/step). Reports the median over rounds and the ratio to the base model.

    .venv/bin/python benchmarks/lora_step.py                     # SmolLM2-135M bf16, B=32, 1 thread
    .venv/bin/python benchmarks/lora_step.py --dtype float32 --json
    .venv/bin/python benchmarks/lora_step.py --model llama2048   # random Llama, hidden 2048 (quantized.py)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time


def default_model(dtype: str) -> str:
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    return ensure_converted(default_model_source(), default_model_dir(dtype), dtype)[0]


def write_adapter(path: str, model_dir: str, rank: int, seed: int) -> str:
    """A random PEFT-layout adapter (every target, rank `rank`) of the model at `model_dir`."""
    import torch
    from safetensors.torch import save_file

    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.lora.adapter import TARGETS, module_shapes

    config = ModelConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (n_in, n_out) in module_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


def build(model: str, dtype: str, batch: int, prompt: int, adapters: list[str]):
    from pdcluster.engine import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.lora.request import LoRARequest

    lora = dict(enable_lora=True, max_loras=8, max_lora_rank=16) if adapters else {}
    engine = LLMEngine(EngineArgs(model=model, dtype=dtype, max_num_seqs=batch, kv_cache_memory=256 << 20, **lora))
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(17, vocab) for _ in range(prompt)],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100_000),
                           lora=requests[i % len(requests)] if requests else None)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    engine.step()
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--model", choices=["smollm2", "llama2048"], default="smollm2", help="without --model-dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--adapters", default="0,1,4,8", help="distinct adapters per variant (0: the base model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.adapters.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model = args.model_dir
        elif args.model == "llama2048":
            from quantized import llama2048  # benchmarks/ is on sys.path when run as a script

            model = llama2048(os.path.join(tmp, "llama2048"))
        else:
            model = default_model(args.dtype)
        paths = [write_adapter(os.path.join(tmp, f"a{i}"), model, 16, i) for i in range(max(counts))]
        engines = {n: build(model, args.dtype, args.batch, args.prompt, paths[:n]) for n in counts}
        times: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n, engine in engines.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[n].append((time.perf_counter() - t) / args.steps * 1e3)
        for engine in engines.values():
            engine.abort_all()
            engine.shutdown()
    base = statistics.median(times[counts[0]])
    result = {"model": model, "dtype": args.dtype, "batch": args.batch, "threads": args.threads,
              "ms_per_step": {n: round(statistics.median(t), 2) for n, t in times.items()},
              "vs_first": {n: round(statistics.median(t) / base, 3) for n, t in times.items()}}
    if args.json:
        print(json.dumps(result))
    else:
        for n in counts:
            print(f"{n} adapters: {result['ms_per_step'][n]:8.2f} ms/step  {result['vs_first'][n]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
