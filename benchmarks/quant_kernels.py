"""Quantized CPU matmuls (engine/quant/kernels.py) against the engine's dense bf16 path (oneDNN-packed weight,
engine/layers/linear.py), same run, interleaved rounds.

    .venv/bin/python benchmarks/quant_kernels.py [--rounds 7] [--iters 10] [--threads N]
    .venv/bin/python benchmarks/quant_kernels.py --gemv [--rows 1] [--rounds 11]

Shapes: a hidden-2048 Llama layer (2048->6144 qkv-ish, 2048->11008 gate/up-ish, 11008->2048 down) and SmolLM2-135M
(576->1536, 1536->576), at 1 and 32 rows, bf16 activations. Each round times every kernel once (the median of
--iters calls); the table prints each kernel's median time over rounds as a ratio to dense (< 1: faster) with the
spread (min-max of the per-round ratios). W4A16 uses groups of 128 where the inputs split into them, else 64.

--gemv: the rate at which decode reads weights, the layers of benchmarks/quantized.py's hidden-2048 Llama at --rows
rows: GB/s of each kernel's own weight bytes (bf16 dense: 2 per weight; W8A16: 1), median [min-max] over rounds,
with enough copies of each weight cycled (>= 96 MiB) that every call reads its weight from DRAM; "read" is the
machine's ceiling, a plain reduction over the int8 bytes (torch's int64 sum over them, all threads).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from pdcluster.engine.layers.linear import cpu_packed, linear
from pdcluster.engine.quant.kernels import pack, quant_linear, resident_bytes
from pdcluster.engine.quant.scheme import QuantScheme, quantize_weight

SHAPES = [("llama-2048 qkv", 2048, 6144), ("llama-2048 up", 2048, 11008), ("llama-2048 down", 11008, 2048),
          ("smollm2 up", 576, 1536), ("smollm2 down", 1536, 576)]
ROWS = (1, 32)


def kernels(in_features: int, out_features: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (matmul, resident bytes)."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features) * 0.02
    dense_w = w.to(torch.bfloat16)
    packed = cpu_packed(dense_w)
    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
        "bf16 dense": (lambda x: linear(x, dense_w, None, packed), dense_w.numel() * 2)}
    group = 128 if in_features % 128 == 0 else 64
    variants = [("w8a16 native", QuantScheme(8), None), ("w8a16 aten", QuantScheme(8), "aten"),
                (f"w4a16 g{group}", QuantScheme(4, group), None),
                (f"w4a16 g{group} asym", QuantScheme(4, group, symmetric=False), None),
                ("w8a8 dyn native", QuantScheme(8, 0, True, "int8_dynamic"), "native"),
                ("w8a8 static native", QuantScheme(8, 0, True, "int8_static"), "native"),
                ("w8a8 dyn onednn", QuantScheme(8, 0, True, "int8_dynamic"), "onednn"),
                ("w8a8 dyn int_mm", QuantScheme(8, 0, True, "int8_dynamic"), "int_mm"),
                ("w8a8 static onednn", QuantScheme(8, 0, True, "int8_static"), "onednn")]
    for name, scheme, variant in variants:
        qw = quantize_weight(w, scheme)
        if scheme.activations == "int8_static":
            qw.input_scale, qw.input_offset = torch.tensor(0.02), torch.tensor(0.0)
        kernel = None if variant is None else "int8pack" if variant == "aten" else "int8mm"
        p = pack(qw, scheme, torch.device("cpu"), torch.bfloat16, kernel=kernel, variant=variant)
        out[name] = ((lambda x, p=p: quant_linear(x, p)), resident_bytes(p))
    return out


GEMV_SHAPES = [("qkv 2048->3072", 2048, 3072), ("o 2048->2048", 2048, 2048), ("gate_up 2048->11264", 2048, 11264),
               ("down 5632->2048", 5632, 2048)]


def gemv_rates(rows: int, rounds: int) -> None:
    print(f"{'layer':<22}{'kernel':<16}{'GB/s':>8}{'spread':>14}{'time vs dense':>15}")
    for label, in_features, out_features in GEMV_SHAPES:
        gemv_layer(label, in_features, out_features, rows, rounds)


def gemv_layer(label: str, in_features: int, out_features: int, rows: int, rounds: int) -> None:
    """Each round: every kernel over all copies twice, the median call; printed per kernel: the median over rounds
    of its GB/s [min-max] and of its per-round time ratio to dense."""
    copies = max(2, -(-(96 << 20) // (in_features * out_features)))
    torch.manual_seed(0)
    scheme, cpu = QuantScheme(8), torch.device("cpu")
    dense, native, aten = [], [], []
    for _ in range(copies):
        w = torch.randn(out_features, in_features) * 0.02
        dense.append((w.to(torch.bfloat16), cpu_packed(w.to(torch.bfloat16))))
        qw = quantize_weight(w, scheme)
        native.append(pack(qw, scheme, cpu, torch.bfloat16))
        aten.append(pack(qw, scheme, cpu, torch.bfloat16, variant="aten"))
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    weights = in_features * out_features
    kernels: dict[str, tuple[Callable[[int], object], int]] = {
        "bf16 dense": (lambda i: linear(x, dense[i][0], None, dense[i][1]), 2 * weights),
        "w8a16 native": (lambda i: quant_linear(x, native[i]), weights),
        "w8a16 aten": (lambda i: quant_linear(x, aten[i]), weights),
        "read": (lambda i: aten[i].weight.view(torch.int64).sum(), weights)}   # type: ignore[union-attr]
    for fn, _ in kernels.values():
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, (fn, _) in kernels.items():
            calls = []
            for i in range(2 * copies):
                start = time.perf_counter()
                fn(i % copies)
                calls.append(time.perf_counter() - start)
            times[name].append(statistics.median(calls))
    for name, (_, nbytes) in kernels.items():
        rates = [nbytes / t / 1e9 for t in times[name]]
        ratio = statistics.median(t / d for t, d in zip(times[name], times["bf16 dense"], strict=True))
        print(f"{label:<22}{name:<16}{statistics.median(rates):>8.1f}{f'{min(rates):.1f}-{max(rates):.1f}':>14}"
              f"{ratio:>15.2f}")


def time_once(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--gemv", action="store_true", help="GB/s of weights read at decode (see above)")
    parser.add_argument("--rows", type=int, default=1, help="--gemv: rows of x")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gemv:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} row(s), {args.rounds} rounds")
        gemv_rates(args.rows, args.rounds)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.iters} calls")
    print(f"{'shape':<18}{'rows':>5}  {'kernel':<22}{'ms':>9}{'vs dense':>10}{'spread':>16}{'bytes vs dense':>16}")
    for label, in_features, out_features in SHAPES:
        ks = kernels(in_features, out_features)
        dense_bytes = ks["bf16 dense"][1]
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            for fn, _ in ks.values():   # warm up (oneDNN primitive caches)
                fn(x)
                fn(x)
            rounds: dict[str, list[float]] = {name: [] for name in ks}
            for _ in range(args.rounds):
                for name, (fn, _) in ks.items():
                    rounds[name].append(time_once(fn, x, args.iters))
            for name, (_, nbytes) in ks.items():
                ratios = [t / d for t, d in zip(rounds[name], rounds["bf16 dense"], strict=True)]
                ms = statistics.median(rounds[name]) * 1e3
                print(f"{label:<18}{rows:>5}  {name:<22}{ms:>9.3f}{statistics.median(ratios):>10.2f}"
                      f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>16}{nbytes / dense_bytes:>16.3f}")


if __name__ == "__main__":
    main()
