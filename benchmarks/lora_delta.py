"""The batched LoRA delta of one q/k/v-sized layer (576 -> 960, SmolLM2's) on CPU, three ways, as extra time over
the layer's base GEMM (min over repeats): masked (engine/lora/layers.py: one shrink over the slots in use, a 0/1
mask per token, one expand), gathered BGMV (each token's A and B gathered, batched matmuls), and a Python loop
over adapter segments (tokens sorted by adapter, one GEMM pair each). 8 slots of rank 16.

    .venv/bin/python benchmarks/lora_delta.py                 # fp32, 1 thread
    .venv/bin/python benchmarks/lora_delta.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def bench(fn, n: int = 30, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def case(tokens: int, used: int, w: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor, rank: int,
         slots: int) -> tuple[float, float, float, float]:
    """(base µs, extra µs masked, gathered BGMV, segment loop) for `tokens` spread over `used` adapters."""
    dtype, hidden = w.dtype, w.shape[1]
    a3, b3 = a_all.view(slots, rank, hidden), b_all.view(slots, rank, -1)
    x = torch.randn(tokens, hidden, dtype=dtype)
    idx = torch.arange(tokens) % used
    mask = (idx.unsqueeze(1) == torch.arange(used)).to(dtype).repeat_interleave(rank, 1)
    a_used, b_used = a_all[:used * rank], b_all[:used * rank]
    order = torch.argsort(idx)
    counts = torch.bincount(idx, minlength=slots).tolist()

    def masked():
        out = F.linear(x, w)
        out.addmm_(F.linear(x, a_used).mul_(mask), b_used)

    def bgmv():
        out = F.linear(x, w)
        shrink = torch.bmm(x.unsqueeze(1), a3[idx].transpose(1, 2))
        out += torch.bmm(shrink, b3[idx]).squeeze(1)

    def segments():
        out = F.linear(x, w)
        xs, delta, start = x[order], torch.empty_like(out), 0
        for s, c in enumerate(counts):
            if c:
                delta[start:start + c] = F.linear(F.linear(xs[start:start + c], a3[s]), b3[s].t())
                start += c
        out.index_add_(0, order, delta)

    base = bench(lambda: F.linear(x, w))
    return base, bench(masked) - base, bench(bgmv) - base, bench(segments) - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hidden, out_features, rank, slots = 576, 576 + 2 * 192, 16, 8
    w = torch.randn(out_features, hidden, dtype=dtype)
    a_all = torch.randn(slots * rank, hidden, dtype=dtype)
    b_all = torch.randn(slots * rank, out_features, dtype=dtype)
    for tokens, used in [(32, 1), (32, 4), (32, 8), (512, 8)]:
        base, masked, bgmv, segments = case(tokens, used, w, a_all, b_all, rank, slots)
        print(f"{tokens} tokens, {used} adapters: base {base:.0f} us; extra: masked {masked:.0f}, "
              f"gathered BGMV {bgmv:.0f}, segment loop {segments:.0f}")


if __name__ == "__main__":
    main()
