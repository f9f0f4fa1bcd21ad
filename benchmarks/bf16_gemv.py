"""bf16 GEMV probe (#27): oneDNN's packed bf16 matmul (`mkldnn._linear_pointwise` over `_reorder_linear_weight`,
what engine/layers/linear.py used for every bf16 CPU linear) vs the native GEMV (engine/layers/bf16_gemv.c, reading
the same packed buffer in place), per layer shape of SmolLM2-135M and of a 2048-hidden model, at m = 1 .. 32 rows.

Each layer is held in enough copies that a pass over them reads at least --working-set MiB,
as a decode step reads every layer's weight once from DRAM; a timed call cycles through the copies. Rounds
alternate the two kernels (same machine load); per shape and m the median over rounds of the time per call, the
weight bytes / time (GB/s) and the ratio ours / oneDNN (< 1: ours faster).

    .venv/bin/python benchmarks/bf16_gemv.py                      # 2 threads (torch's default here)
    .venv/bin/python benchmarks/bf16_gemv.py --threads 1 --rows 1,8 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdcluster.engine.attention.native import bf16_gemm
from pdcluster.engine.layers.linear import cpu_packed

SHAPES = {   # name: (in, out)
    "smollm2.qkv": (576, 960), "smollm2.o": (576, 576), "smollm2.gate": (576, 1536), "smollm2.down": (1536, 576),
    "smollm2.lm_head": (576, 49152),
    "h2048.qkv": (2048, 2560), "h2048.o": (2048, 2048), "h2048.gate": (2048, 5632), "h2048.down": (5632, 2048),
    "h2048.lm_head": (2048, 32000),
}


def timed(fn, copies: list, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(x, copies[i % len(copies)])
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--working-set", type=int, default=128, help="MiB per layout read by a pass over the copies")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per variant per round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        weight = torch.randn(n, k).to(torch.bfloat16)
        count = max(1, -(-args.working_set * 2**20 // weight.nbytes))
        packed = [cpu_packed(weight) for _ in range(count)]
        assert all(p is not None and p.gemv for p in packed), "no native GEMV for this layout / machine"
        variants = {"onednn": (lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), packed),
                    "native": (lambda x, p, n=n: bf16_gemm(x, p.gemv[0], n, p.gemv[2], p.gemv[1]), packed)}
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            want = x.float() @ weight.float().T
            for fn, copies in variants.values():   # correctness, and warm-up
                got = fn(x, copies[0]).float()
                assert (got - want).abs().max() <= want.abs().max() * 2**-7 + 1e-3, name
            calls = {v: max(count, int(args.min_time / timed(fn, copies, x, count))) for v, (fn, copies) in
                     variants.items()}
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, (fn, copies) in variants.items():
                    times[v].append(timed(fn, copies, x, calls[v]))
            med = {v: statistics.median(t) for v, t in times.items()}
            row = {"shape": name, "in": k, "out": n, "m": m, "threads": args.threads,
                   **{f"{v}_us": round(t * 1e6, 1) for v, t in med.items()},
                   **{f"{v}_gbs": round(weight.nbytes / t / 1e9, 1) for v, t in med.items()},
                   "ratio": round(med["native"] / med["onednn"], 3)}
            results.append(row)
            if not args.json:
                print(f"{name:16s} {k:5d}->{n:<6d} m={m:<3d} oneDNN {row['onednn_us']:8.1f} us "
                      f"({row['onednn_gbs']:5.1f} GB/s)  native {row['native_us']:8.1f} us "
                      f"({row['native_gbs']:5.1f} GB/s)  ratio {row['ratio']:.3f}", flush=True)
        del packed, variants
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
