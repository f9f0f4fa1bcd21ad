"""Long-context prefill and decode: time to first token and decode ms/token at 8k, 32k and 128k tokens.

Model: the tests' tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16) with a
131072-position range and llama3 rope scaling (`--rope yarn` for yarn), fp32; optionally (`--real`) the
default model SmolLM2-135M-Instruct at its 8192-token limit. One request at a time: the prompt is prefilled
in chunks of `--chunk` tokens (chunked prefill; each chunk attends to the cached context in bounded tiles),
then `--decode` tokens are generated (native decode kernel). Prints one JSON line per run and a markdown table.

    .venv/bin/python benchmarks/long_context.py                       # 8k and 32k, tiny model
    .venv/bin/python benchmarks/long_context.py --lengths 8192 32768 131072 --real
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.llm_engine import LLMEngine

ROPE = {"llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192),
        "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)}


def run_one(model: str, length: int, chunk: int, decode: int, dtype: str, block_size: int = 16) -> dict:
    blocks = -(-(length + decode) // block_size) + 2
    engine = LLMEngine(EngineArgs(model=model, dtype=dtype, block_size=block_size, max_num_batched_tokens=chunk,
                                  num_gpu_blocks_override=blocks))
    vocab = engine.model_config.vocab_size
    rng = random.Random(length)
    prompt = [rng.randrange(3, min(vocab, 30000)) for _ in range(length)]
    params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
    engine.add_request("r", prompt, params)
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    pool_mib = engine.kv_pool.tensor.numel() * engine.kv_pool.tensor.element_size() / 2**20
    return dict(tokens=length, chunk=chunk, ttft_s=round(first - start, 3),
                decode_ms_per_token=round((end - first) * 1000 / max(1, decode - 1), 2),
                kv_pool_mib=round(pool_mib, 1), max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rope", choices=sorted(ROPE), default="llama3")
    ap.add_argument("--real", action="store_true", help="also SmolLM2-135M-Instruct at 8k (its context)")
    args = ap.parse_args()
    from pdcluster.engine.testing import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, "llama", seed=3, max_position_embeddings=131072, rope_theta=500000.0,
                                rope_scaling=dict(ROPE[args.rope]))
        for n in args.lengths:
            row = dict(model=f"tiny llama ({args.rope})", dtype="float32",
                       **run_one(model, n, args.chunk, args.decode, "float32"))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.real:
        from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

        model = ensure_converted(default_model_source(), default_model_dir("bfloat16"), "bfloat16")[0]
        row = dict(model="SmolLM2-135M-Instruct", dtype="bfloat16",
                   **run_one(model, 8192 - args.decode, args.chunk, args.decode, "bfloat16"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\ntorch threads {torch.get_num_threads()}\n")
    print("| model | dtype | prompt tokens | chunk | TTFT (s) | decode ms/token | KV pool MiB | max RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['tokens']} | {r['chunk']} | {r['ttft_s']} | "
              f"{r['decode_ms_per_token']} | {r['kv_pool_mib']} | {r['max_rss_mib']} |")


if __name__ == "__main__":
    main()
