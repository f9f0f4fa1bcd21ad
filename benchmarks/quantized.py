"""Decode speed of quantized weights against bf16, same run: output tokens/s of the engine decoding a batch of
requests (prompt 32 tokens, `--tokens` out, ignore_eos) at batch 1 and 32, one engine per scheme loaded at once
and timed in alternation round by round (the order rotates), on two models:

  smollm2    the default model (SmolLM2-135M-Instruct), converted once per scheme (bf16 activations)
  llama2048  a random Llama with hidden 2048, 4 layers, intermediate 5632, vocab 32000 (weights dominate a step)

Schemes: bf16 (the baseline), w8a16, w8a8, w4a16 (`convert_model(quantization=...)`); a "+lm_head" suffix
(`--schemes w8a16+lm_head ...`) quantizes the LM head too (`quantize_lm_head`). Printed per model and batch:
tokens/s per scheme (median over rounds), the per-round ratio to bf16 (median [min-max]), and the resident bytes
of the decoder layers' linear weights per scheme.

    .venv/bin/python benchmarks/quantized.py                              # both models, batch 1 and 32, 3 rounds
    .venv/bin/python benchmarks/quantized.py --models llama2048 --batches 1 --rounds 5
    .venv/bin/python benchmarks/quantized.py --schemes w8a16 w8a16+lm_head w4a16+lm_head --batches 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.convert import convert_model, default_model_source
from pdcluster.engine.layers.linear import Linear
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.testing import make_tiny_model

SCHEMES = ["w8a16", "w8a8", "w4a16"]
KV_POOL_BYTES = 512 << 20   # per engine: batch 32 x (32 + 64) tokens of SmolLM2 take ~70 MiB


def llama2048(path: str) -> str:
    """A random Llama with hidden 2048 (4 layers, intermediate 5632, vocab 32000): weights dominate a step."""
    return make_tiny_model(path, "llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=2048, tokenizer_vocab_size=400)


def checkpoints(model: str, root: str, schemes: list[str]) -> dict[str, str]:
    if model == "smollm2":
        src = default_model_source()
    else:
        src = llama2048(f"{root}/llama2048-src")
    return {s: convert_model(src, f"{root}/{model}-{s}", "bfloat16",
                             quantization=None if s == "bf16" else s.removesuffix("+lm_head"),
                             quantize_lm_head=s.endswith("+lm_head"))
            for s in schemes}


def linear_bytes(engine: LLMEngine) -> int:
    from pdcluster.engine.quant.kernels import resident_bytes

    total = 0
    for name, m in engine.runner.model.named_modules():
        if isinstance(m, Linear) and ".layers." in f".{name}":
            if m.quant is not None:
                total += resident_bytes(m.quant)
            else:
                total += m.packed.numel() * m.packed.element_size() if m.packed is not None \
                    else m.weight.numel() * m.weight.element_size()
    mlp_halves = [m.packed_halves for m in engine.runner.model.modules() if getattr(m, "packed_halves", None)]
    total += sum(h.numel() * h.element_size() for pair in mlp_halves for h in pair)
    return total


def lm_head_bytes(engine: LLMEngine) -> int:
    """The LM head's own resident bytes: its quantized or oneDNN-packed copy, else its dense weight."""
    from pdcluster.engine.quant.kernels import resident_bytes

    head = engine.runner.model.lm_head
    if head.quant is not None:
        return resident_bytes(head.quant)
    weight = head.packed if head.packed is not None else head.weight
    return weight.numel() * weight.element_size()


def decode_rate(engine: LLMEngine, batch: int, tokens: int, tag: str) -> float:
    """Output tokens per second of the decode steps (prefill steps excluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [(7 * i + j) % 300 + 3 for j in range(32)], params)
    engine.step()   # the prompts (one chunk)
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama2048"], choices=["smollm2", "llama2048"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schemes", nargs="+", default=SCHEMES,
                    help="besides bf16: w8a16 | w8a8 | w4a16, each optionally +lm_head")
    args = ap.parse_args()
    schemes = ["bf16", *args.schemes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            dirs = checkpoints(model, root, schemes)
            # a small KV pool each: left unset, every engine takes up to 4 GiB, and five of them ran out of memory
            engines = {s: LLMEngine(EngineArgs(model=d, dtype="bfloat16", max_num_seqs=max(args.batches),
                                               kv_cache_memory=KV_POOL_BYTES))
                       for s, d in dirs.items()}
            sizes = {s: linear_bytes(e) for s, e in engines.items()}
            heads = {s: lm_head_bytes(e) for s, e in engines.items()}
            print(f"\n{model}: decoder-layer linear weights / LM head " +
                  ", ".join(f"{s} {sizes[s] / 2**20:.1f} / {heads[s] / 2**20:.1f} MiB" for s in schemes))
            for batch in args.batches:
                rates: dict[str, list[float]] = {s: [] for s in schemes}
                for r in range(args.rounds):
                    order = schemes[r % len(schemes):] + schemes[:r % len(schemes)]
                    for s in order:
                        rates[s].append(decode_rate(engines[s], batch, args.tokens, f"{s}-{r}"))
                print(f"  batch {batch}:")
                for s in schemes:
                    ratios = [a / b for a, b in zip(rates[s], rates["bf16"], strict=True)]
                    print(f"    {s:14s} {statistics.median(rates[s]):8.1f} tok/s  x{statistics.median(ratios):.2f} "
                          f"[{min(ratios):.2f}-{max(ratios):.2f}]")
            for e in engines.values():
                e.shutdown()


if __name__ == "__main__":
    main()
