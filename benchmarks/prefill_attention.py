"""Prefill attention probe: the CPU backend's native paged-prefill kernel (engine/attention/paged_prefill.c) against
the torch backend's path (CPU flash SDPA, `TorchAttentionBackend._prefill`), interleaved round by round in one
process so both see the same machine load.

Each case is one prompt chunk: `n` new query rows after `cached` positions already in the pool (block size 16,
blocks scattered), a layer's K/V in the pool through its block table, as a prefill step runs it per layer.
Reports per case and dtype the median ms per call of each side over the rounds, [min-max], and the ratio
(torch / native: above 1, the kernel is faster).

    .venv/bin/python benchmarks/prefill_attention.py                  # SmolLM2's heads (9 / 3 x 64), 1 thread
    .venv/bin/python benchmarks/prefill_attention.py --threads 2 --rounds 7 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

# (label, cached, n, hq, hkv, d)
CASES = [
    ("smollm2 2k prompt", 0, 2048, 9, 3, 64),
    ("smollm2 512 prompt", 0, 512, 9, 3, 64),
    ("smollm2 128 prompt", 0, 128, 9, 3, 64),
    ("smollm2 chunk 2k after 6k", 6144, 2048, 9, 3, 64),
    ("llama-8b heads, 2k prompt", 0, 2048, 32, 8, 128),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    from paged_decode_cases import prefill_case

    from pdcluster.engine.attention.cpu_backend import CpuAttentionBackend
    from pdcluster.engine.attention.metadata import PrefillChunk
    from pdcluster.engine.attention.torch_backend import TorchAttentionBackend

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for label, cached, n, hq, hkv, d in CASES:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            q, k, v, k_cache, v_cache, table = prefill_case(dtype, cached, n, hq, hkv, d, 16)
            chunk = PrefillChunk(start=0, end=n, num_cached=cached, block_table=table)
            sides = {"native": CpuAttentionBackend(hq, hkv, d), "torch": TorchAttentionBackend(hq, hkv, d)}
            times: dict[str, list[float]] = {s: [] for s in sides}
            for r in range(args.rounds + 1):   # round 0 warms up
                order = list(sides) if r % 2 else list(sides)[::-1]
                for side in order:
                    t = time.perf_counter()
                    sides[side]._prefill(q, k[cached:], v[cached:], k_cache, v_cache, chunk, 0)
                    if r:
                        times[side].append((time.perf_counter() - t) * 1e3)
            med = {s: statistics.median(ts) for s, ts in times.items()}
            flops = 4 * n * (cached + (n + 1) / 2) * hq * d   # QK^T and PV over the causal keys
            row = {"case": label, "dtype": name, "threads": args.threads,
                   **{f"{s}_ms": round(med[s], 2) for s in sides},
                   **{f"{s}_ms_range": [round(min(ts), 2), round(max(ts), 2)] for s, ts in times.items()},
                   "native_gflops": round(flops / med["native"] / 1e6, 1),
                   "ratio": round(med["torch"] / med["native"], 2)}
            rows.append(row)
            if not args.json:
                print(f"{label:28s} {name}: native {med['native']:8.1f} ms [{min(times['native']):.1f}-"
                      f"{max(times['native']):.1f}]  torch {med['torch']:8.1f} ms [{min(times['torch']):.1f}-"
                      f"{max(times['torch']):.1f}]  {row['ratio']:.2f}x  ({row['native_gflops']} GFLOP/s)", flush=True)
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "rows": rows}))


if __name__ == "__main__":
    main()
