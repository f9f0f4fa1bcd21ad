"""A/B of one engine under two environments: the engine's switches that are read at process start (e.g.
PDCLUSTER_FUSED_OPS=0: torch's elementwise ops instead of engine/layers/fused_ops.c; PDCLUSTER_MALLOC_TUNING=0:
glibc's own malloc thresholds, engine/malloc.py; PDCLUSTER_NATIVE_MATMUL=0; PDCLUSTER_NATIVE_PREFILL=0: torch's SDPA
instead of engine/attention/paged_prefill.c) compared in fresh processes, A and B
alternated round by round (ABBA), so drift of the machine hits both alike.

Each process builds the engine on the model (default: SmolLM2-135M-Instruct, converted once), then times
- prefill: `LLM.generate` of N prompts of L random token ids, one output token (best of 3 calls after a warm-up;
  prefix caching off, so every call computes its prompts), for each `--prefill N:L`;
- decode: ms per engine step with B sequences decoding (128-token prompts; 20 steps after 5), for each `--decode B`;
and reports the minor page faults of its prefill calls. Prints per figure A's and B's runs, medians and the ratio
A / B (below 1: A is faster).

    .venv/bin/python benchmarks/env_ab.py --b PDCLUSTER_FUSED_OPS=0                 # the fused kernels' gain
    .venv/bin/python benchmarks/env_ab.py --b PDCLUSTER_MALLOC_TUNING=0 --rounds 4  # the malloc thresholds'
    .venv/bin/python benchmarks/env_ab.py --a PDCLUSTER_NATIVE_MATMUL=0 --b X=1 --dtype bfloat16 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, random, resource, sys, time
import torch
from pdcluster.engine import LLM, SamplingParams
model, dtype, threads, prefills, decodes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.set_num_threads(threads)
llm = LLM(model=model, dtype=dtype, kv_cache_memory=1 << 30, max_num_seqs=64, enable_prefix_caching=False)
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
out, faults = {}, 0
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
prompts = lambda n, l: [{"prompt_token_ids": [rng.randrange(17, vocab) for _ in range(l)]} for _ in range(n)]
for spec in filter(None, prefills.split(",")):
    n, l = map(int, spec.split(":"))
    llm.generate(prompts(n, l), one)
    times = []
    for _ in range(3):
        batch = prompts(n, l)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        llm.generate(batch, one)
        times.append(time.perf_counter() - t)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    out[f"prefill {n}x{l} ms"] = round(min(times) * 1000, 1)
engine = llm.engine
for b in map(int, filter(None, decodes.split(","))):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(b):
        engine.add_request(f"{b}-{i}", [rng.randrange(17, vocab) for _ in range(128)], params)
    for _ in range(5):
        engine.step()
    t = time.perf_counter()
    for _ in range(20):
        engine.step()
    out[f"decode b{b} ms/step"] = round((time.perf_counter() - t) * 50, 2)
    while engine.has_unfinished_requests():
        engine.step()
out["prefill minor faults"] = faults
print(json.dumps(out))
"""


def env_arg(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def default_model(dtype: str) -> str:
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    return ensure_converted(default_model_source(), default_model_dir(dtype), dtype)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=env_arg, default={}, help="A's environment additions: NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--b", type=env_arg, required=True, help="B's environment additions")
    ap.add_argument("--model-dir", help="default: SmolLM2-135M-Instruct, converted once")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="1:2048,2:128", help="N:L prompt sets")
    ap.add_argument("--decode", default="1,32", help="batch sizes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = args.model_dir or default_model(args.dtype)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            env = {**os.environ, **(args.a if side == "A" else args.b)}
            done = subprocess.run([sys.executable, "-c", PROBE, model, args.dtype, str(args.threads), args.prefill,
                                   args.decode], env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {side}: {runs[side][-1]}", file=sys.stderr)
    result = {"a": args.a, "b": args.b, "dtype": args.dtype, "threads": args.threads,
              "load_average": os.getloadavg(), "figures": {}}
    for key in runs["A"][0]:
        a, b = [x[key] for x in runs["A"]], [x[key] for x in runs["B"]]
        ma, mb = statistics.median(a), statistics.median(b)
        result["figures"][key] = {"A": a, "B": b, "ratio": round(ma / mb, 3) if mb else None}
        if not args.json:
            ratio = f"{ma / mb:.2f}" if mb else "-"
            print(f"{key:24s} A {ma:9.1f} {a}   B {mb:9.1f} {b}   A/B {ratio}")
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
