"""Offline throughput: this engine vs transformers `generate`, measured in the same run.

A random Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, intermediate 2816, vocab 32000) is
written to a temp dir. Requests: prompt and output lengths uniform in [16, 256], fixed seed, greedy
with ignore_eos. For each dtype it measures
  engine              `engine.LLM.generate` over all requests (continuous batching)
  hf one-at-a-time    transformers `generate` per request, on the first --baseline-requests only
  hf static batches   transformers `generate` in left-padded batches of --static-batch; each batch
                      runs to its longest member, only each member's requested tokens count
and prints output tokens/s, engine/static and engine/one-at-a-time ratios, the batch-1 decode time
per token (engine vs transformers), and the engine's model-FLOP utilisation against a large matmul
timed in the same dtype in the same run.

    .venv/bin/python benchmarks/offline_throughput.py            # full (~10 min on 2 cores)
    .venv/bin/python benchmarks/offline_throughput.py --quick    # < 2 min
    .venv/bin/python benchmarks/offline_throughput.py --device cuda --dtypes bf16   # both sides on the GPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

MODEL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
FIRST_REGULAR_TOKEN = 3   # 0..2 are pad/bos/eos in the engine.testing tokenizer


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompt = [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(plen)]
        out.append(Request(prompt, rng.randint(*output_range)))
    return out


def make_model(path: str) -> str:
    from pdcluster.engine.testing import make_tiny_model  # LlamaConfig + LlamaForCausalLM.save_pretrained + tokenizer

    return make_tiny_model(path, arch="llama", **MODEL)


def count_params(model_dir: str) -> tuple[int, int]:
    """(parameters used in matmuls per token: everything but the embedding table, total)."""
    import glob

    from safetensors import safe_open

    matmul = total = 0
    for f in glob.glob(f"{model_dir}/*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                n = st.get_slice(name).get_shape()
                size = 1
                for d in n:
                    size *= d
                total += size
                if "embed_tokens" not in name:
                    matmul += size
    return matmul, total


def matmul_gflops(dtype: torch.dtype, device: str = "cpu", m: int = 2048, k: int = 1024, n: int = 2816,
                  repeats: int = 5) -> float:
    a = torch.randn(m, k).to(device, dtype)
    b = torch.randn(k, n).to(device, dtype)
    inner = 20 if device.startswith("cuda") else 1    # one GPU product takes microseconds: time several
    torch.matmul(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * m * k * n / best / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def attention_flops(reqs: list[Request], hidden: int, layers: int) -> float:
    """QK^T and PV for every processed token against its causal context: 4 * ctx * hidden per layer."""
    total = 0
    for r in reqs:
        n = len(r.prompt) + r.max_tokens - 1     # tokens run through the model
        total += n * (n + 1) // 2                # sum of context lengths
    return 4.0 * hidden * layers * total


# ---------------------------------------------------------------- engine
def engine_llm(model_dir: str, dtype: torch.dtype, args):
    from pdcluster.engine import LLM

    return LLM(model=model_dir, dtype=dtype, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
               max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
               device=args.device.split(":")[0], enforce_eager=not args.compile)


def engine_generate(llm, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    from pdcluster.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    for r, toks in zip(reqs, tokens, strict=True):
        if len(toks) != r.max_tokens:
            raise RuntimeError(f"engine returned {len(toks)} tokens, asked for {r.max_tokens}")
    return elapsed, tokens


# ---------------------------------------------------------------- transformers
def hf_model(model_dir: str, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_generate_batch(model, reqs: list[Request], pad_id: int = 0) -> list[list[int]]:
    """Left-padded batch run to its longest member; returns each member's requested tokens."""
    width = max(len(r.prompt) for r in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    new = max(r.max_tokens for r in reqs)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=pad_id)
    return [out[i, width:width + r.max_tokens].tolist() for i, r in enumerate(reqs)]


def hf_one_at_a_time(model, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    tokens = [hf_generate_batch(model, [r])[0] for r in reqs]
    return time.perf_counter() - t, tokens


def hf_static(model, reqs: list[Request], batch: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        hf_generate_batch(model, reqs[i:i + batch])
    return time.perf_counter() - t


def decode_ms_per_token(run, prompt: list[int], short: int, long: int) -> float:
    """Batch-1 decode step time: (time(long output) - time(short output)) / (long - short),
    which cancels prefill and per-call overhead. Best of three each: one run swings by ±20 % here."""
    t_short = min(_timed(run, Request(prompt, short)) for _ in range(3))
    t_long = min(_timed(run, Request(prompt, long)) for _ in range(3))
    return (t_long - t_short) / (long - short) * 1e3


def _timed(run, req: Request) -> float:
    t = time.perf_counter()
    run(req)
    return time.perf_counter() - t


# ---------------------------------------------------------------- main
def bench_dtype(name: str, dtype: torch.dtype, model_dir: str, reqs: list[Request], warmup: list[Request], args,
                matmul_params: int, cfg: dict) -> dict:
    res: dict = {"dtype": name}
    out_tokens = sum(r.max_tokens for r in reqs)
    base = reqs[:args.baseline_requests]
    static_reqs = reqs[:args.static_requests] if args.static_requests else reqs
    decode_prompt = reqs[0].prompt[:16]
    warm = [Request(reqs[0].prompt[:16], 4)]

    gflops = matmul_gflops(dtype, args.device)
    res["matmul_gflops"] = round(gflops, 1)
    log(f"[{name}] matmul 2048x1024x2816: {gflops:.0f} GFLOP/s")

    engine_tokens = None
    if not args.skip_engine:
        try:
            llm = engine_llm(model_dir, dtype, args)
        except ImportError as e:
            log(f"[{name}] engine unavailable ({e}); skipping the engine part")
            llm = None
        if llm is not None:
            # A first pass over other requests of the same distribution (random prompts, so no prefix-cache
            # hits): a fresh process runs its first such workload ~15-25 % slower on this box.
            engine_generate(llm, warmup)
            elapsed, engine_tokens = engine_generate(llm, reqs)
            res["engine_tok_s"] = round(out_tokens / elapsed, 1)
            res["engine_s"] = round(elapsed, 2)
            log(f"[{name}] engine: {len(reqs)} requests, {out_tokens} output tokens in {elapsed:.1f}s "
                f"= {res['engine_tok_s']} tok/s")
            flops = 2.0 * matmul_params * sum(len(r.prompt) + r.max_tokens - 1 for r in reqs) \
                + attention_flops(reqs, cfg["hidden_size"], cfg["num_hidden_layers"])
            res["engine_gflops"] = round(flops / elapsed / 1e9, 1)
            res["engine_mfu_vs_matmul"] = round(flops / elapsed / 1e9 / gflops, 3)
            log(f"[{name}] engine model FLOPs: {res['engine_gflops']} GFLOP/s = "
                f"{100 * res['engine_mfu_vs_matmul']:.1f}% of the matmul rate")
            res["engine_decode_ms"] = round(decode_ms_per_token(lambda r: engine_generate(llm, [r]), decode_prompt,
                                                                 args.decode_short, args.decode_long), 2)
            log(f"[{name}] engine batch-1 decode: {res['engine_decode_ms']} ms/token")
            llm.engine.shutdown()   # tensor-parallel ranks stop before the next engine forms its group
            del llm
            gc.collect()

    if not args.skip_hf:
        model = hf_model(model_dir, dtype, args.device)
        hf_generate_batch(model, warm)
        hf_generate_batch(model, warmup[:args.static_batch])   # same courtesy: one static batch first
        elapsed, hf_tokens = hf_one_at_a_time(model, base)
        base_tokens = sum(r.max_tokens for r in base)
        res["hf_one_tok_s"] = round(base_tokens / elapsed, 1)
        res["hf_one_requests"] = len(base)
        log(f"[{name}] transformers one-at-a-time (first {len(base)} requests only, {base_tokens} tokens): "
            f"{res['hf_one_tok_s']} tok/s")
        if engine_tokens is not None:
            engine_base = engine_tokens[:len(base)]   # the engine ran every request, transformers the first few
            same = sum(a == b for a, b in zip(engine_base, hf_tokens, strict=True))
            prefix = [_common_prefix(a, b) / len(b) for a, b in zip(engine_base, hf_tokens, strict=True)]
            res["greedy_identical"] = f"{same}/{len(base)}"
            res["greedy_mean_common_prefix"] = round(sum(prefix) / len(prefix), 3)
            log(f"[{name}] engine vs transformers greedy outputs identical for {same}/{len(base)} requests "
                f"(mean common prefix {100 * res['greedy_mean_common_prefix']:.0f}%)")
        static_tokens = sum(r.max_tokens for r in static_reqs)
        elapsed = hf_static(model, static_reqs, args.static_batch)
        res["hf_static_tok_s"] = round(static_tokens / elapsed, 1)
        res["hf_static_requests"] = len(static_reqs)
        log(f"[{name}] transformers static batches of {args.static_batch} ({len(static_reqs)} requests): "
            f"{res['hf_static_tok_s']} tok/s")
        res["hf_decode_ms"] = round(decode_ms_per_token(lambda r: hf_generate_batch(model, [r]), decode_prompt,
                                                         args.decode_short, args.decode_long), 2)
        log(f"[{name}] transformers batch-1 decode: {res['hf_decode_ms']} ms/token")
        del model
        gc.collect()

    if "engine_tok_s" in res and "hf_static_tok_s" in res:
        res["engine_vs_static"] = round(res["engine_tok_s"] / res["hf_static_tok_s"], 2)
        res["engine_vs_one_at_a_time"] = round(res["engine_tok_s"] / res["hf_one_tok_s"], 2)
        res["decode_step_speedup"] = round(res["hf_decode_ms"] / res["engine_decode_ms"], 2)
    return res


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def log(msg: str) -> None:
    print(msg, file=sys.stderr if ARGS.json else sys.stdout, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-requests", type=int, default=8,
                   help="transformers one-at-a-time runs on this many of the requests (it is slow)")
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--static-requests", type=int, default=0, help="0: all requests")
    p.add_argument("--decode-short", type=int, default=8)
    p.add_argument("--decode-long", type=int, default=136)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="engine ranks (CPU: processes sharing the cores; each gets threads / N)")
    p.add_argument("--device", help="cpu, cuda or npu, for the engine and transformers alike (default: the "
                   "engine's choice, npu > cuda > cpu)")
    p.add_argument("--model-dir", help="reuse a model directory instead of writing one to a temp dir")
    p.add_argument("--compile", action="store_true", help="engine with enforce_eager=False (torch.compile)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="32 requests, lengths 16..64; baselines on 2 (one-at-a-time) and 16 (static) requests")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_requests = 32
        args.prompt_len, args.output_len = (16, 64), (16, 64)
        args.baseline_requests = min(args.baseline_requests, 2)
        args.static_requests = args.static_requests or args.static_batch
        args.decode_short, args.decode_long = 4, 24
        args.kv_cache_gib = min(args.kv_cache_gib, 0.5)
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: unknown dtype {d!r}; use fp32 and/or bf16")
    return args


ARGS = None


def main(argv=None) -> dict:
    global ARGS
    ARGS = args = parse_args(argv)
    from pdcluster.engine.device import resolve_device

    args.device = str(resolve_device(args.device))
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-") as tmp:
        model_dir = args.model_dir or make_model(tmp)
        matmul_params, total_params = count_params(model_dir)
        reqs = make_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                             MODEL["vocab_size"], args.seed)
        warmup = make_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                               MODEL["vocab_size"], args.seed + 1)
        result = {
            "model": {**MODEL, "params": total_params, "matmul_params": matmul_params},
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "output_tokens": sum(r.max_tokens for r in reqs),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
            "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
            "quick": args.quick,
            "compile": args.compile,
            "load_average": os.getloadavg(),
            "results": [],
        }
        log(f"model: {total_params / 1e6:.0f}M params; {len(reqs)} requests, {result['prompt_tokens']} prompt + "
            f"{result['output_tokens']} output tokens; torch threads {torch.get_num_threads()}")
        for name in args.dtypes.split(","):
            result["results"].append(
                bench_dtype(name, DTYPES[name], model_dir, reqs, warmup, args, matmul_params, MODEL))
    summary(result)
    if args.json:
        print(json.dumps(result))
    return result


def summary(result: dict) -> None:
    log("")
    log(f"{'dtype':6} {'engine tok/s':>12} {'static tok/s':>12} {'1-at-a-time':>12} {'eng/static':>10} "
        f"{'eng/1x1':>8} {'decode ms eng/hf':>17} {'MFU':>6}")
    for r in result["results"]:
        dec = f"{r.get('engine_decode_ms', '-')}/{r.get('hf_decode_ms', '-')}"
        mfu = f"{100 * r['engine_mfu_vs_matmul']:.1f}%" if "engine_mfu_vs_matmul" in r else "-"
        log(f"{r['dtype']:6} {r.get('engine_tok_s', '-'):>12} {r.get('hf_static_tok_s', '-'):>12} "
            f"{r.get('hf_one_tok_s', '-'):>12} {r.get('engine_vs_static', '-'):>10} "
            f"{r.get('engine_vs_one_at_a_time', '-'):>8} {dec:>17} {mfu:>6}")
    log("one-at-a-time runs on a subset of the requests (see above); MFU = model FLOPs/s over the "
        "matmul rate in the same dtype.")


if __name__ == "__main__":
    main()
