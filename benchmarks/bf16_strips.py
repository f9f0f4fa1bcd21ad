"""bf16 matmuls on CPUs where oneDNN packs no bf16 weight (AVX2 only, #27): torch's `F.linear` in bf16 (what runs
there without this kernel, and what vLLM-CPU falls back to: one GEMV per row) vs engine/layers/bf16_strips.c over the
weight in its strip layout, with oneDNN's fp32 matmul over an fp32 copy of the weight (`onednn_packed`) as the
yardstick, per layer shape of SmolLM2-135M and of a 2048-hidden model, at m = 1 .. 1024 rows.

Each layer is held in enough copies that a pass over them reads at least --working-set MiB of bf16 weights (a decode
step reads every layer's weight once from DRAM); a timed call cycles through the copies. Rounds alternate the three
(same machine load); per shape and m the median time per call over rounds and the ratios torch / strips and
fp32 / strips (> 1: the strips faster).

    .venv/bin/python benchmarks/bf16_strips.py [--rows 1,16,256] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from bf16_gemv import SHAPES

from pdcluster.engine.attention import native
from pdcluster.engine.layers.linear import onednn_packed, packed_matmul


def per_call(fn, copies: list, x: torch.Tensor, min_s: float = 0.2) -> float:
    fn(x, copies[0])
    calls, start = 0, time.perf_counter()
    while calls < len(copies) or time.perf_counter() - start < min_s:
        fn(x, copies[calls % len(copies)])
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64,256,1024")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--working-set", type=int, default=64, help="MiB of bf16 weights a pass over the copies reads")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not native.bf16_strips_vectorized():
        raise SystemExit("no AVX2 + FMA vector path for bf16_strips.c on this machine")
    sides = {
        "torch": lambda x, w: F.linear(x, w[0]),
        "strips": lambda x, w: native.bf16_strips_gemm(x, w[1]),
        "fp32": lambda x, w: packed_matmul(x.float(), w[2], None),
    }
    results = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        count = max(1, (args.working_set << 20) // (2 * n * k))
        g = torch.Generator().manual_seed(0)
        copies = []
        for _ in range(count):
            w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
            copies.append((w, native.bf16_strips(w), onednn_packed(w.float())))
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            times: dict[str, list[float]] = {s: [] for s in sides}
            for _ in range(args.rounds):
                for side, fn in sides.items():
                    times[side].append(per_call(fn, copies, x))
            med = {s: statistics.median(t) for s, t in times.items()}
            row = {"shape": name, "m": m, **{f"{s}_ms": round(t * 1e3, 4) for s, t in med.items()},
                   "torch_over_strips": round(med["torch"] / med["strips"], 2),
                   "fp32_over_strips": round(med["fp32"] / med["strips"], 2),
                   "strips_gbps": round(2 * n * k / med["strips"] / 1e9, 1)}
            results.append(row)
            if not args.json:
                print(f"{name:14s} m={m:5d}  torch bf16 {row['torch_ms']:8.3f} ms  strips {row['strips_ms']:8.3f} ms  "
                      f"oneDNN fp32 {row['fp32_ms']:8.3f} ms  torch/strips {row['torch_over_strips']:5.2f}x  "
                      f"fp32/strips {row['fp32_over_strips']:5.2f}x  ({row['strips_gbps']} GB/s of bf16 weight)",
                      flush=True)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
