"""KV blocks device-to-device between two processes on one GPU through CUDA IPC, every byte checked.

The receiver (this process, a decode node's side) allocates a zeroed block pool on the GPU and hands it to a
sender process (a prefill node's side) through torch.multiprocessing, which passes a CUDA IPC handle, not the
data. The sender fills its own pool with random bytes and writes chosen blocks (random ids on both sides) into
the receiver's pool three ways, each into its own range of receiver blocks:
  contiguous  one copy of n consecutive blocks (the best case: memcpy speed)
  indexed     `index_copy_(index_select(...))`, one gather and one scatter whatever the ids
  per_block   one `copy_` per block (what a loop over a block table does)
and times them (synchronised). It then hands its pool back the same way; the receiver compares every written
block with its source bit for bit (int16 views, so NaN patterns count too) and checks that no other block of its
pool changed. Block = 16 layers x 2 x 16 tokens x 2 KV heads x 128 x bf16 = 256 KiB, as in kv_transfer.py.

    python benchmarks/kv_cuda_ipc.py [--sizes 16,1024] [--json]
    python benchmarks/kv_cuda_ipc.py --device cpu --sizes 4,8   # the same plumbing over shared host memory

Exit codes: 0 every byte matched, 1 a mismatch or the sender failed, 3 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

BLOCK_SHAPE = (16, 2, 16, 2, 128)   # layers, K/V, tokens, KV heads, head dim
DTYPE = torch.bfloat16
METHODS = ("contiguous", "indexed", "per_block")
BLOCK_BYTES = torch.Size(BLOCK_SHAPE).numel() * DTYPE.itemsize
EXIT_NO_DEVICE = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_blocks(method: str, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                 s_idx: torch.Tensor, d_idx: torch.Tensor) -> None:
    if method == "contiguous":
        dst[dst_ids[0]:dst_ids[0] + len(dst_ids)].copy_(src[src_ids[0]:src_ids[0] + len(src_ids)])
    elif method == "indexed":
        dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
    else:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[d].copy_(src[s])


def plan(sizes: list[int], src_blocks: int, seed: int) -> list[dict]:
    """For each size and method: source ids and the receiver ids it writes, disjoint from every other write."""
    rng = random.Random(seed)
    out, next_dst = [], 0
    for n in sizes:
        for method in METHODS:
            dst_ids = list(range(next_dst, next_dst + n))
            next_dst += n
            if method == "contiguous":
                start = rng.randrange(0, src_blocks - n + 1)
                src_ids = list(range(start, start + n))
            else:
                src_ids = rng.sample(range(src_blocks), n)
                rng.shuffle(dst_ids)
            out.append({"method": method, "blocks": n, "src_ids": src_ids, "dst_ids": dst_ids})
    return out


def sender(inbox, outbox, done, writes: list[dict], src_blocks: int, repeats: int, device: str) -> None:
    """The prefill side: opens the receiver's pool, writes the planned blocks into it, shares its own pool back."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        t = time.perf_counter()
        dst = inbox.get()                     # the receiver's pool, mapped through its IPC handle
        sync(dev)
        open_ms = (time.perf_counter() - t) * 1e3
        src = torch.randint(-2**15, 2**15, (src_blocks, *BLOCK_SHAPE), dtype=torch.int16, device=dev).view(DTYPE)
        timings = []
        for w in writes:
            s_idx = torch.tensor(w["src_ids"], device=dev)
            d_idx = torch.tensor(w["dst_ids"], device=dev)
            write_blocks(w["method"], src, dst, w["src_ids"], w["dst_ids"], s_idx, d_idx)   # warm-up
            sync(dev)
            t = time.perf_counter()
            for _ in range(repeats):
                write_blocks(w["method"], src, dst, w["src_ids"], w["dst_ids"], s_idx, d_idx)
            sync(dev)
            seconds = (time.perf_counter() - t) / repeats
            timings.append({"ms": round(seconds * 1e3, 4),
                            "gb_s": round(w["blocks"] * BLOCK_BYTES / seconds / 1e9, 2)})
        outbox.put({"src": src, "open_ms": round(open_ms, 2), "timings": timings})   # raises if IPC is refused
        done.wait(120)                       # keep `src` alive until the receiver has compared
    except BaseException:
        outbox.put({"error": traceback.format_exc()})


def run(sizes: list[int], repeats: int, device: str, seed: int = 0, tamper: bool = False) -> dict:
    """`tamper` (tests): change one element the sender wrote before comparing, to show the check sees it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())   # torch.cuda.set_device wants an index
    src_blocks = max(2 * max(sizes), 64)
    writes = plan(sizes, src_blocks, seed)
    recv_blocks = sum(len(w["dst_ids"]) for w in writes) + 16   # 16 blocks nobody writes
    dst = torch.zeros((recv_blocks, *BLOCK_SHAPE), dtype=DTYPE, device=dev)
    ctx = mp.get_context("spawn")
    # SimpleQueue pickles in put()'s caller, so a refused IPC handle raises here, not in a feeder thread
    inbox, outbox, done = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.Event()
    child = ctx.Process(target=sender, args=(inbox, outbox, done, writes, src_blocks, repeats, str(dev)),
                        daemon=True)
    child.start()
    result: dict = {"device": str(dev), "block_bytes": BLOCK_BYTES, "repeats": repeats, "writes": []}
    try:
        try:
            inbox.put(dst)
        except Exception:
            return {**result, "error": "sharing the receiver's pool: " + traceback.format_exc(), "bytes_equal": False}
        reply = None
        deadline = time.monotonic() + 240
        while reply is None and time.monotonic() < deadline:
            alive = child.is_alive()
            if not outbox.empty():
                reply = outbox.get()
            elif not alive:
                break
            else:
                time.sleep(0.02)
        if reply is None or "error" in reply:
            result["error"] = (reply or {}).get("error") or f"sender exited with code {child.exitcode} and no reply"
            result["bytes_equal"] = False
            return result
        src = reply["src"]                    # the sender's pool, mapped back the same way
        sync(dev)
        if tamper:
            dst[writes[-1]["dst_ids"][-1]].view(torch.int16).view(-1)[7] ^= 1
        written = torch.zeros(recv_blocks, dtype=torch.bool, device=dev)
        all_equal = True
        for w, timing in zip(writes, reply["timings"], strict=True):
            s_idx = torch.tensor(w["src_ids"], device=dev)
            d_idx = torch.tensor(w["dst_ids"], device=dev)
            equal = torch.equal(dst.index_select(0, d_idx).view(torch.int16),
                                src.index_select(0, s_idx).view(torch.int16))
            written[d_idx] = True
            all_equal &= equal
            result["writes"].append({"method": w["method"], "blocks": w["blocks"],
                                     "mib": w["blocks"] * BLOCK_BYTES / 2**20, **timing, "bytes_equal": equal})
        untouched_zero = int(dst[~written].view(torch.int16).count_nonzero().item()) == 0
        result.update(open_ms=reply["open_ms"], untouched_blocks_zero=untouched_zero,
                      bytes_equal=bool(all_equal and untouched_zero))
        del src, reply                        # the sender may free its pool now
        return result
    finally:
        done.set()
        child.join(10)
        if child.is_alive():
            child.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,1024", help="comma list of block counts per write (256 KiB blocks)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (CUDA IPC) or cpu (shared host memory: a dry run)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kv_cuda_ipc: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return EXIT_NO_DEVICE
    result = run([int(s) for s in args.sizes.split(",")], args.repeats, args.device)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"device {result['device']}, sender opened the receiver's pool in {result.get('open_ms', '-')} ms")
        for w in result["writes"]:
            print(f"{w['method']:10} {w['blocks']:5} blocks ({w['mib']:.0f} MiB): {w['ms']:9.3f} ms  "
                  f"{w['gb_s']:8.2f} GB/s  bytes equal: {w['bytes_equal']}")
        if "error" in result:
            print(result["error"], file=sys.stderr)
        print(f"every written block equal to its source, the rest untouched: {result['bytes_equal']}")
    return 0 if result["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
