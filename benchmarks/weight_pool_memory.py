"""Resident memory of engines with private weights vs a SharedWeightPool (docs/benchmarks.md).

    .venv/bin/python benchmarks/weight_pool_memory.py [--hidden 512 --layers 8 --vocab 32000]

Builds two random Llama checkpoints (weights dominate: ~230 MB each in fp32 at the defaults), then runs each
scenario in fresh processes that load their engines and generate a few tokens, and reads their RSS and PSS
(psutil `memory_full_info`, from the parent while they wait). PSS splits each shared page among the
processes mapping it, so the sum of PSS over processes is the memory they really hold together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid

CHILD = """
import json, sys
from pdcluster import SamplingParams, SharedWeightPool
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.llm_engine import LLMEngine
models, pool = json.loads(sys.argv[1]), sys.argv[2]
engines = [LLMEngine(EngineArgs(model=m, weight_pool=pool or None, num_gpu_blocks_override=16)) for m in models]
for i, e in enumerate(engines):
    e.add_request("r", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
used = engines[0].weight_pool.used_bytes if engines[0].weight_pool is not None else 0
print(json.dumps({"pool_used": used}), flush=True)
sys.stdin.read()
"""


def run(groups: list[list[str]], pool: str) -> dict:
    """One process per group of models (all started, then measured together)."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(g), pool], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for g in groups]
    try:
        ready = [json.loads(p.stdout.readline()) for p in procs]
        mem = [psutil.Process(p.pid).memory_full_info() for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(120)
    mib = 2 ** 20
    return {"rss_mib": [round(m.rss / mib) for m in mem], "pss_mib": [round(m.pss / mib) for m in mem],
            "pss_sum_mib": round(sum(m.pss for m in mem) / mib), "pool_mib": round(ready[0]["pool_used"] / mib)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    from pdcluster.engine.testing import make_tiny_model

    work = tempfile.mkdtemp(prefix="wpool-")
    shape = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab)
    a = make_tiny_model(os.path.join(work, "a"), "llama", seed=1, **shape)
    b = make_tiny_model(os.path.join(work, "b"), "llama", seed=2, **shape)
    weights = sum(os.path.getsize(os.path.join(a, f)) for f in os.listdir(a) if f.endswith(".safetensors"))
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"{weights / 2**20:.0f} MiB of weights")
    scenarios = {
        "1 engine": [[a]],
        "2 engines, same model, 1 process": [[a, a]],
        "2 processes, same model": [[a], [a]],
        "2 engines, different models, 1 process": [[a, b]],
    }
    for name, groups in scenarios.items():
        for label, pool in (("private", ""), ("pool", f"bench-{uuid.uuid4().hex[:8]}:2GiB")):
            print(f"{name:42s} {label:8s} {json.dumps(run(groups, pool))}", flush=True)


if __name__ == "__main__":
    main()
