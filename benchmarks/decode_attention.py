"""CPU decode attention: the native paged kernel vs the torch path (gather + SDPA), same inputs, same run.

A pool laid out as the engine's (layer-major, several layers, scattered block tables), B decode rows
with contexts uniform in [--min-len, --max-len]; each call is one layer of one decode step. Prints the
median time per call of both, their ratio, and the K/V bytes read per second against the machine's
read bandwidth measured in the same run (a sum over a 1 GiB tensor, which reads every byte once). Every call
reads layer 0 (cache-resident where the CPU's caches hold a layer), or with `--cycle-layers` the next layer each
time, as a decode step does.
With `--kv-dtype int8` the same K/V is also quantized into an int8 pool (engine/kv_cache.py: int8 values and
an fp16 scale per token and KV head) and both paths run over it too, in the same run.
With `--baseline-rev REV` the kernel of that commit (its paged_decode.c and paged_simd.h, built with the same flags)
runs on the same inputs too, alternating with this tree's kernel for `--rounds` rounds (each kernel's median per
round; reported: the median over rounds [min-max] and the ratio baseline / this tree, per cache dtype).

    .venv/bin/python benchmarks/decode_attention.py [--dtype bf16] [--kv-dtype int8] [--batch 64] [--json]
    .venv/bin/python benchmarks/decode_attention.py --dtype fp32 --heads 9 --kv-heads 3 --head-dim 64 \
        --block-size 128 --batch 64 --min-len 2048 --max-len 2304 --layers 4 --cycle-layers --baseline-rev HEAD~1
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from pdcluster.engine.attention import native
from pdcluster.engine.attention.metadata import AttentionMetadata
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.kv_cache import quantize_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(args, dtype):
    g = torch.Generator().manual_seed(args.seed)
    bs, hq, hkv, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g).sort().values
    blocks = [-(-int(n) // bs) for n in lens]
    num_blocks = 2 * sum(blocks)
    pool = torch.empty(args.layers, 2, num_blocks, bs, hkv, d, dtype=dtype)   # engine/kv_cache.py's layout
    pool.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[:args.batch * max(blocks)].view(args.batch, max(blocks)).to(torch.int32)
    q = torch.randn(args.batch, hq + hkv, d, generator=g).to(dtype)[:, :hq]
    none = torch.zeros(0, dtype=torch.int32)
    meta = TorchAttentionBackend.prepare(AttentionMetadata(   # the torch path's per-step metadata
        slot_mapping=none, num_decode_tokens=args.batch, decode_block_tables=tables,
        decode_context_lens=lens.to(torch.int32)))
    return q, meta, lens, pool


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def baseline_library(rev: str, tmp: str) -> ctypes.CDLL:
    """paged_decode.c of commit `rev` (and the header it includes), built as engine/attention/native.py builds."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    for name in ("paged_decode.c", "paged_simd.h"):
        text = subprocess.run(["git", "show", f"{rev}:engine/attention/{name}"], capture_output=True, text=True,
                              check=True, cwd=root).stdout
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    out = os.path.join(tmp, "baseline.so")
    subprocess.run([shutil.which("cc") or "gcc", *native.FLAGS, os.path.join(tmp, "paged_decode.c"), "-o", out, "-lm"],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(out)
    for symbol in native._SYMBOLS.values():
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn.argtypes, fn.restype = native._ARGTYPES, ctypes.c_int
    return lib


def against_baseline(rev: str, dtype: torch.dtype, pools: dict, q, meta, layers, args) -> dict:
    """Per cache dtype: this tree's kernel and `rev`'s, alternating round by round on the same calls."""
    scale = args.head_dim ** -0.5
    with tempfile.TemporaryDirectory(prefix="pdcluster-decode-baseline-") as tmp:
        lib = baseline_library(rev, tmp)
        result = {}
        for cache_dtype, pool in pools.items():
            kernels = {"now": native.decode_kernel(dtype, cache_dtype),
                       "baseline": getattr(lib, native._SYMBOLS[(dtype, cache_dtype)])}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for r in range(args.rounds):
                for name in (("now", "baseline") if r % 2 == 0 else ("baseline", "now")):
                    times[name].append(median_s(lambda k=kernels[name], pool=pool: native.paged_decode(
                        k, q, *pool[next(layers)], meta.decode_block_tables, meta.decode_context_lens, scale),
                        args.repeats))
            med = {name: statistics.median(t) for name, t in times.items()}
            result[str(cache_dtype).removeprefix("torch.")] = {
                **{f"{name}_ms": [round(med[name] * 1e3, 3), round(min(t) * 1e3, 3), round(max(t) * 1e3, 3)]
                   for name, t in times.items()},
                "baseline_over_now": round(med["baseline"] / med["now"], 3)}
    return result


def read_gbps() -> float:
    x = torch.ones(1 << 28)
    return x.numel() * 4 / median_s(x.sum, 5) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: also time both paths over an int8 copy of the pool")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cycle-layers", action="store_true",
                   help="each call reads the next layer, as a decode step does (with enough layers the K/V comes "
                        "from memory, not from the CPU's caches); default: every call reads layer 0")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--baseline-rev", help="also time this commit's kernel (git rev), alternating with this tree's")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds of --baseline-rev")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    kernel = native.decode_kernel(dtype)
    if kernel is None:
        raise SystemExit("native kernel unavailable here (no C compiler?): nothing to compare")
    q, meta, lens, pool = make_inputs(args, dtype)
    torch_path = TorchAttentionBackend(args.heads, args.kv_heads, args.head_dim)
    scale = args.head_dim ** -0.5
    kv_bytes = int(lens.sum()) * args.kv_heads * args.head_dim * 2 * pool.element_size()
    limit_before = read_gbps()
    layers = itertools.cycle(range(args.layers) if args.cycle_layers else [0])   # the layer each call reads
    t_torch = median_s(lambda: torch_path._decode(q, *pool[next(layers)], meta), args.repeats)
    t_native = median_s(lambda: native.paged_decode(kernel, q, *pool[next(layers)], meta.decode_block_tables,
                                                    meta.decode_context_lens, scale), args.repeats)
    limit = (limit_before + read_gbps()) / 2
    out = {"dtype": args.dtype, "batch": args.batch, "lens": [args.min_len, args.max_len],
           "threads": torch.get_num_threads(), "kv_mib": round(kv_bytes / 2**20, 1),
           "torch_ms": round(t_torch * 1e3, 3), "native_ms": round(t_native * 1e3, 3),
           "speedup": round(t_torch / t_native, 2), "native_gbps": round(kv_bytes / t_native / 1e9, 1),
           "torch_gbps": round(kv_bytes / t_torch / 1e9, 1), "read_limit_gbps": round(limit, 1),
           "native_vs_limit": round(kv_bytes / t_native / 1e9 / limit, 2)}
    if args.kv_dtype == "int8":
        pool8 = torch.empty(*pool.shape[:-1], args.head_dim + 2, dtype=torch.int8)
        for layer in range(args.layers):   # a layer at a time: quantizing goes through fp32
            pool8[layer] = quantize_rows(pool[layer])
        kernel8 = native.decode_kernel(dtype, torch.int8)
        t_torch8 = median_s(lambda: torch_path._decode(q, *pool8[next(layers)], meta), args.repeats)
        t_native8 = median_s(lambda: native.paged_decode(kernel8, q, *pool8[next(layers)], meta.decode_block_tables,
                                                         meta.decode_context_lens, scale), args.repeats)
        t_native_again = median_s(lambda: native.paged_decode(kernel, q, *pool[next(layers)], meta.decode_block_tables,
                                                              meta.decode_context_lens, scale), args.repeats)
        kv8_bytes = int(lens.sum()) * args.kv_heads * (args.head_dim + 2) * 2
        out.update({"int8_kv_mib": round(kv8_bytes / 2**20, 1), "int8_torch_ms": round(t_torch8 * 1e3, 3),
                    "int8_native_ms": round(t_native8 * 1e3, 3),
                    "native_ms_after": round(t_native_again * 1e3, 3),
                    "int8_vs_native": round(min(t_native, t_native_again) / t_native8, 2),
                    "int8_native_gbps": round(kv8_bytes / t_native8 / 1e9, 1)})
    if args.baseline_rev:
        pools = {dtype: pool, **({torch.int8: pool8} if args.kv_dtype == "int8" else {})}
        out["baseline"] = {"rev": args.baseline_rev,
                           **against_baseline(args.baseline_rev, dtype, pools, q, meta, layers, args)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.dtype}, {args.batch} rows, contexts {args.min_len}..{args.max_len}, "
          f"{out['kv_mib']} MiB of K/V per call, {out['threads']} threads")
    print(f"  torch (gather + SDPA): {out['torch_ms']:8.3f} ms  {out['torch_gbps']:5.1f} GB/s")
    print(f"  native paged kernel:   {out['native_ms']:8.3f} ms  {out['native_gbps']:5.1f} GB/s  "
          f"({out['speedup']}x; {out['native_vs_limit']:.0%} of the {out['read_limit_gbps']} GB/s read limit)")
    if args.kv_dtype == "int8":
        print(f"int8 KV ({out['int8_kv_mib']} MiB per call, same tokens):")
        print(f"  torch (gather + dequantize + SDPA): {out['int8_torch_ms']:8.3f} ms")
        print(f"  native paged kernel:   {out['int8_native_ms']:8.3f} ms  {out['int8_native_gbps']:5.1f} GB/s  "
              f"({out['int8_vs_native']}x the {args.dtype} kernel, best of its runs before and after: "
              f"{out['native_ms']} / {out['native_ms_after']} ms)")
    if args.baseline_rev:
        print(f"against {args.baseline_rev}'s kernel, {args.rounds} alternating rounds, ms per call median [min-max]:")
        for cache, r in out["baseline"].items():
            if cache == "rev":
                continue
            now, base = r["now_ms"], r["baseline_ms"]
            print(f"  {cache} cache: this tree {now[0]} [{now[1]}-{now[2]}], {args.baseline_rev} {base[0]} "
                  f"[{base[1]}-{base[2]}]: {r['baseline_over_now']}x")


if __name__ == "__main__":
    main()
