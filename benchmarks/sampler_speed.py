"""Sampler time per batch: this tree's `engine/sampler.py` against another copy of it (an earlier
revision's: `git show REV:engine/sampler.py > /tmp/old_sampler.py`), interleaved in one process.

Workload: B rows of V logits (bf16, as the LM head returns them), each request with a 128-token prompt and
`--outputs` generated tokens, seeded; the settings under test (greedy, temperature only, top-k/top-p, and those
plus repetition/frequency/presence penalties).

    .venv/bin/python benchmarks/sampler_speed.py --other /tmp/old_sampler.py [--batch 64] [--vocab 49152]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine import sampler as ours

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "penalties": dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2,
                      presence_penalty=0.1),
}


def load(path: str):
    spec = importlib.util.spec_from_file_location("other_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="path of the sampler module to compare with")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--outputs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = load(args.other)
    rng = random.Random(0)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)).mul_(3).bfloat16()
    prompts = [[rng.randrange(args.vocab) for _ in range(128)] for _ in range(args.batch)]
    outputs = [[rng.randrange(args.vocab) for _ in range(args.outputs)] for _ in range(args.batch)]
    result = {"batch": args.batch, "vocab": args.vocab, "threads": args.threads, "load_average": os.getloadavg()}
    with torch.inference_mode():
        for case, kw in CASES.items():
            times: dict[str, list[float]] = {"ours": [], "other": []}
            tokens = {}
            for _ in range(args.repeats):
                for name, module in (("ours", ours), ("other", other)):
                    reqs = [module.SampleRequest(SamplingParams(seed=i, **kw), prompts[i], outputs[i])
                            for i in range(args.batch)]
                    sampler = module.Sampler(seed=0)
                    t = time.perf_counter()
                    tokens[name] = sampler(logits, reqs)[0]
                    times[name].append((time.perf_counter() - t) * 1e3)
            result[case] = {name: round(statistics.median(v), 2) for name, v in times.items()}
            result[case]["same_tokens"] = tokens["ours"] == tokens["other"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
