"""The strip matmul on CPUs with AVX2 and no AVX-512 (#27), engine/layers/strips_gemm.c over the weight in its strip
layout, per layer shape of SmolLM2-135M and of a 2048-hidden model, at m = 1 .. 1024 rows:
- bf16 weights (where oneDNN packs none): against torch's `F.linear` in bf16 (what runs there without this kernel,
  and what vLLM-CPU falls back to: one GEMV per row) and oneDNN's fp32 matmul over an fp32 copy of the weight;
- fp32 weights: against oneDNN's fp32 matmul over its own packed copy (what `cpu_packed` gave before, and what
  vLLM-CPU runs in fp32) and torch's `F.linear` over the plain weight (MKL's sgemm).

Each layer is held in enough copies that a pass over them reads at least --working-set MiB of weights (a decode
step reads every layer's weight once from DRAM); a timed call cycles through the copies. Rounds alternate the sides
(same machine load); per shape and m the median time per call over rounds and the ratios other / strips (> 1: the
strips faster), and the strips' rate in weight bytes read and in GFLOP/s (at many rows the products are bound by
the arithmetic: what the CPU's peak leaves to gain).

    .venv/bin/python benchmarks/strips_gemm.py [--dtypes bf16,fp32] [--rows 1,16,256] [--rounds 3] [--json]
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
from pdcluster.engine.layers.linear import packed_matmul

# per weight dtype: side -> (the weight's copy it multiplies by, the call); the strips first
SIDES = {
    "bf16": {"strips": (lambda w: native.strips_layout(w), lambda x, w: native.strips_gemm(x, w)),
             "torch_bf16": (lambda w: w, lambda x, w: F.linear(x, w)),
             "onednn_fp32": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.float(), 128),
                             lambda x, w: packed_matmul(x.float(), w, None))},
    "fp32": {"strips": (lambda w: native.strips_layout(w), lambda x, w: native.strips_gemm(x, w)),
             "onednn_fp32": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 128),
                             lambda x, w: packed_matmul(x, w, None)),
             "torch_fp32": (lambda w: w, lambda x, w: F.linear(x, w))},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def per_call(fn, copies: list, x: torch.Tensor, min_s: float = 0.2) -> float:
    fn(x, copies[0])
    calls, start = 0, time.perf_counter()
    while calls < len(copies) or time.perf_counter() - start < min_s:
        fn(x, copies[calls % len(copies)])
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rows", default="1,4,16,64,256,1024")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--working-set", type=int, default=64, help="MiB of weights a pass over the copies reads")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if native.strips_vector_level() == 0:
        raise SystemExit("no AVX2 + FMA vector path for strips_gemm.c on this machine")
    results = []
    for dtype in args.dtypes.split(","):
        sides = SIDES[dtype]
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            wbytes = n * k * DTYPES[dtype].itemsize
            g = torch.Generator().manual_seed(0)
            copies = []
            for _ in range(max(1, (args.working_set << 20) // wbytes)):
                w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DTYPES[dtype])
                copies.append({side: make(w) for side, (make, _) in sides.items()})
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=g).to(DTYPES[dtype])
                times: dict[str, list[float]] = {s: [] for s in sides}
                for _ in range(args.rounds):
                    for side, (_, call) in sides.items():
                        times[side].append(per_call(lambda x, c, s=side, f=call: f(x, c[s]), copies, x))
                med = {s: statistics.median(t) for s, t in times.items()}
                row = {"dtype": dtype, "shape": name, "m": m, **{f"{s}_ms": round(t * 1e3, 4) for s, t in med.items()},
                       **{f"{s}_over_strips": round(t / med["strips"], 2) for s, t in med.items() if s != "strips"},
                       "strips_gbps": round(wbytes / med["strips"] / 1e9, 1),
                       "strips_gflops": round(2 * m * k * n / med["strips"] / 1e9, 1)}
                results.append(row)
                if not args.json:
                    print(f"{dtype} {name:14s} m={m:5d}  " + "  ".join(f"{s} {row[f'{s}_ms']:8.3f} ms" for s in sides)
                          + "  " + "  ".join(f"{s}/strips {row[f'{s}_over_strips']:5.2f}x" for s in sides
                                             if s != "strips")
                          + f"  ({row['strips_gbps']} GB/s of weight, {row['strips_gflops']} GFLOP/s)",
                          flush=True)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
