"""Accuracy of the int8 KV cache against the model-dtype (bf16) one on the default model (SmolLM2-135M-Instruct).

Two measurements, same weights, same run:
  * greedy generation: N chat prompts x T tokens with `kv_cache_dtype="auto"` (bf16) and `"int8"`; prints how
    many sequences are identical and the mean share of each sequence generated before its first divergence;
  * with --control, the noise floor of that comparison: the same model-dtype KV through the torch attention
    path instead of the native kernel (same math, different rounding), compared the same way;
  * perplexity of a fixed English text (teacher-forced, one prefill over the paged pool, whose attention reads
    the int8 values back as decode does) with both KV dtypes, and the relative increase.

    .venv/bin/python benchmarks/kv_int8_accuracy.py [--dtype bfloat16] [--tokens 128] [--prompts 16] [--control]
                                                    [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pdcluster import LLM, SamplingParams
from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted
from pdcluster.engine.testing import prefill_logits

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the sea.", "Give three tips for learning a new language.",
    "What causes the seasons on Earth?", "Summarise the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?", "Write a short story about a lost robot.",
    "What is the difference between weather and climate?", "List five healthy breakfast ideas.",
    "Explain what a prime number is, with examples.", "Why is the sky blue?",
    "Describe how to make a cup of tea.", "What are the benefits of regular exercise?",
    "Write a polite email asking for a meeting next week.", "How do vaccines work?",
    "What is machine learning?", "Tell me about the history of the printing press.",
]

TEXT = (
    "The river rose slowly through the spring, and by the end of April the lower fields were under water. "
    "Farmers moved their animals to the hills and waited, as their parents had done before them, for the "
    "water to fall again. In the village the old stone bridge held, although the current pulled at its "
    "arches day and night. Children gathered on the bank after school to watch branches and broken fences "
    "drift past, and once a small wooden boat with no one in it. The schoolteacher used the flood as a "
    "lesson: she explained how rain in the mountains, weeks earlier and many miles away, had filled the "
    "streams that fed the river, and how the melting snow added to it. She drew the valley on the board, "
    "with its slopes and its narrow gorge, and showed why the water gathered here rather than anywhere "
    "else. When the river finally returned to its bed in May, it left behind a thin layer of dark mud. "
    "The farmers knew that this mud was rich, and that the crops planted in it would grow tall. By the "
    "middle of summer the fields were green again, and the flood was remembered mostly in stories told "
    "in the evenings, when people sat outside their houses and talked about the weather, the harvest, "
    "and the price of grain at the market in town. The bridge was repaired in the autumn. Engineers came "
    "from the city to inspect it, measured the stones, and declared that it would stand for another "
    "hundred years, provided that the village cleared the branches from its arches after every storm."
)


def generate(model: str, dtype: str, kv_cache_dtype: str, prompts: list[str], tokens: int,
             backend: str | None = None) -> tuple[list[list[int]], float]:
    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=1024,
              attention_backend=backend)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    t = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    elapsed = time.perf_counter() - t
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


def perplexity(model: str, dtype: str, kv_cache_dtype: str) -> float:
    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=1024)
    engine = llm.engine
    ids = engine.tokenizer.encode(TEXT)
    blocks = list(range(-(-len(ids) // engine.block_size)))
    logits = prefill_logits(engine, ids, blocks)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="model dtype (the reference KV dtype)")
    p.add_argument("--model", default=None, help="converted model dir; default: the default model in --dtype")
    p.add_argument("--control", action="store_true", help="also measure the noise floor (see above)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model = args.model or ensure_converted(default_model_source(), default_model_dir(args.dtype), args.dtype)[0]
    prompts = PROMPTS[:args.prompts]
    ref, t_ref = generate(model, args.dtype, "auto", prompts, args.tokens)
    got, t_int8 = generate(model, args.dtype, "int8", prompts, args.tokens)
    ppl_ref, ppl_int8 = perplexity(model, args.dtype, "auto"), perplexity(model, args.dtype, "int8")
    out = {"dtype": args.dtype, "prompts": len(prompts), "tokens": args.tokens, **agreement(ref, got),
           "ppl_ref": round(ppl_ref, 4), "ppl_int8": round(ppl_int8, 4),
           "ppl_rel_increase_pct": round(100 * (ppl_int8 / ppl_ref - 1), 3),
           "generate_s_ref": round(t_ref, 1), "generate_s_int8": round(t_int8, 1)}
    if args.control:
        control, _ = generate(model, args.dtype, "auto", prompts, args.tokens, backend="torch")
        out["control"] = agreement(ref, control)
    if args.json:
        print(json.dumps(out))
        return
    print(f"greedy, {out['prompts']} prompts x {out['tokens']} tokens: {out['identical']}/{out['prompts']} identical "
          f"to {args.dtype} KV, {out['mean_share_before_divergence']:.1%} of tokens before the first divergence (mean)")
    if args.control:
        print(f"  noise floor ({args.dtype} KV, torch attention path vs native kernel): "
              f"{out['control']['identical']}/{out['prompts']} identical, "
              f"{out['control']['mean_share_before_divergence']:.1%} before the first divergence")
    print(f"perplexity of the fixed text: {args.dtype} KV {out['ppl_ref']}, int8 KV {out['ppl_int8']} "
          f"({out['ppl_rel_increase_pct']:+.2f} %)")
    print(f"generation time: {args.dtype} KV {out['generate_s_ref']} s, int8 KV {out['generate_s_int8']} s")


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Identical sequences, and the mean share of each reference sequence before the first differing token."""
    shares = []
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        shares.append(n / max(1, len(a)))
    return {"identical": sum(a == b for a, b in zip(ref, got, strict=True)),
            "mean_share_before_divergence": round(sum(shares) / len(shares), 3)}


if __name__ == "__main__":
    main()
