"""KV transfer throughput and latency between two processes, next to this machine's physical limits.

    .venv/bin/python benchmarks/kv_transfer.py [--json] [--backends shm,tcp,gloo] [--sizes 1,4,16,256]
    .venv/bin/python benchmarks/kv_transfer.py --int8-greedy   # effect of int8 wire compression on greedy output

The receiver (decode side) runs in this process with its pool in POSIX shm; the sender (prefill side)
is a spawned process. Times are sender-side, start() → finish() returned (the receiver has verified
the checksum and acknowledged). Block: 16 layers × 2 × 16 tokens × 2 KV heads × 128 × bf16 = 256 KiB,
so 4 MiB is the "16-block transfer" of the latency target. Pools have the engine's layout (engine/kv_cache.py:
[layers, k|v, blocks, block_size, heads, head_dim], one contiguous K and V cache per layer), so a block is 32
pieces of 8 KiB, one per layer and k|v, and a run of consecutive blocks one range per plane. Limits, measured in
the same run: memcpy = torch copy_ into a preallocated buffer; socket = raw sendall → recv_into over loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdcluster.kv_transfer import KVReceiver, KVSender, SharedKVPool  # noqa: E402

LAYERS, BLOCK = (16, 2), (16, 2, 128)  # (layers, k/v), (block_size, kv heads, head_dim)
BLOCK_BYTES = 16 * 2 * 16 * 2 * 128 * 2


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (*LAYERS, num_blocks, *BLOCK)
DTYPE = torch.bfloat16


def reps_for(size_mib: int) -> int:
    return max(8, min(200, 512 // size_mib))


def _sender_main(conn, num_blocks: int) -> None:
    pool = torch.randn(pool_shape(num_blocks)).to(DTYPE)
    senders: dict[tuple[str, int], KVSender] = {}
    sock = None
    junk = memoryview(bytearray(num_blocks * BLOCK_BYTES))
    conn.send("ready")  # the parent measures nothing until this process is idle
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "connect":
            sock = socket.create_connection(("127.0.0.1", msg[1]))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            continue
        if msg[0] == "socket":  # raw baseline: sendall, wait for the one-byte answer
            sock.sendall(junk[: msg[1]])
            sock.recv(1)
            continue
        _, backend, streams, dst = msg
        key = (backend, streams)
        if key not in senders:
            senders[key] = KVSender(pool, backend=backend, num_streams=streams)
        t0 = time.perf_counter()
        t = senders[key].start(dst, list(range(len(dst["block_ids"]))))
        t.send_all()
        t.finish(timeout=60)
        conn.send(time.perf_counter() - t0)


class Limits:
    """The physical limits, measured right before and right after the transfers of each size: this VM's
    memory bandwidth drifts by 2x over minutes, so limits measured once up front mislead."""

    def __init__(self, conn, max_bytes: int):
        self.conn = conn
        self.src = torch.randn(max_bytes // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.buf = memoryview(bytearray(max_bytes))
        lsock = socket.create_server(("127.0.0.1", 0))
        conn.send(("connect", lsock.getsockname()[1]))
        self.sock, _ = lsock.accept()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lsock.close()

    def memcpy_s(self, nbytes: int) -> float:
        """torch copy_ into a preallocated buffer (all cores)."""
        n = nbytes // 4
        t0 = time.perf_counter()
        self.dst[:n].copy_(self.src[:n])
        return time.perf_counter() - t0

    def socket_s(self, nbytes: int) -> float:
        """The child sendall's nbytes over loopback, we recv_into a preallocated buffer and answer."""
        self.conn.send(("socket", nbytes))
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += self.sock.recv_into(self.buf[got:nbytes])
        self.sock.sendall(b"k")
        return time.perf_counter() - t0


def gbps(nbytes: int, times: list[float]) -> float:
    return round(nbytes * len(times) / sum(times) / 1e9, 2)


def int8_greedy(num_prompts: int = 16, max_tokens: int = 32) -> dict:
    """Greedy tokens of a tiny random model, prompt KV exact vs round-tripped through int8 (as a decode
    node would receive it with quant="int8"): the first token comes from prefill, the rest from decode."""
    import tempfile

    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.testing import make_tiny_model
    from pdcluster.kv_transfer import quant

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, dtype in (("llama", "float32"), ("qwen2", "bfloat16")):
            path = make_tiny_model(f"{tmp}/{arch}", arch=arch, num_key_value_heads=2)
            g = torch.Generator().manual_seed(0)
            lengths = torch.randint(8, 48, (num_prompts,), generator=g)
            prompts = [torch.randint(3, 400, (int(n),), generator=g).tolist() for n in lengths]
            runs = []
            for lossy in (False, True):
                eng = LLMEngine(EngineArgs(model=path, dtype=dtype, kv_cache_memory=64 << 20,
                                           max_num_batched_tokens=4096))
                for i, p in enumerate(prompts):
                    eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                toks: dict[str, list[int]] = {}
                first = True
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        if o.finished:   # the finished output carries the whole completion
                            toks[o.request_id] = list(o.outputs[0].token_ids)
                    if first and lossy:  # prompt KV is all in the pool now: pass it through the wire format
                        pool = eng.kv_pool.tensor
                        pool.copy_(quant.dequantize(quant.quantize(pool), tuple(pool.shape), pool.dtype))
                    first = False
                runs.append([toks[f"r{i}"] for i in range(num_prompts)])
            exact, lossy_toks = runs
            same_tokens = sum(a == b for x, y in zip(exact, lossy_toks, strict=True) for a, b in zip(x, y, strict=True))
            out[f"{arch}-{dtype}"] = {
                "prompts": num_prompts, "max_tokens": max_tokens,
                "identical_sequences": sum(x == y for x, y in zip(exact, lossy_toks, strict=True)),
                "token_agreement": round(same_tokens / (num_prompts * max_tokens), 4),
            }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--backends", default="shm,tcp,gloo")
    ap.add_argument("--sizes", default="1,4,16,256")
    ap.add_argument("--streams", type=int, default=1, help="parallel tcp connections")
    ap.add_argument("--int8-greedy", action="store_true", help="only measure int8 KV's effect on greedy output")
    args = ap.parse_args()
    if args.int8_greedy:
        print(json.dumps(int8_greedy()))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    max_blocks = max(sizes) * (1 << 20) // BLOCK_BYTES

    shm = SharedKVPool.create(pool_shape(max_blocks), DTYPE)
    rx = KVReceiver(shm.tensor, shm_name=shm.name)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_sender_main, args=(child_conn, max_blocks), daemon=True)
    child.start()
    if not conn.poll(120) or conn.recv() != "ready":
        raise SystemExit("sender process did not start")
    limits = Limits(conn, max_blocks * BLOCK_BYTES)
    backends = args.backends.split(",")
    results = []
    n = 0

    def measure_limits(times: dict[str, list[float]], nbytes: int, reps: int) -> None:
        for _ in range(reps):
            times["memcpy"].append(limits.memcpy_s(nbytes))
            times["socket"].append(limits.socket_s(nbytes))

    for size in sizes:
        nblocks = size * (1 << 20) // BLOCK_BYTES
        nbytes = nblocks * BLOCK_BYTES
        reps = reps_for(size)
        times: dict[str, list[float]] = {b: [] for b in ["memcpy", "socket", *backends]}
        measure_limits(times, nbytes, reps)
        for backend in backends:  # back to back, so p50 is the latency of a transfer, not of a cold cache
            for i in range(reps + 1):  # rep 0 warms up (connects, compiles) and is dropped
                n += 1
                dst = rx.reserve(f"r{n}", list(range(nblocks)))
                conn.send(("xfer", backend, args.streams, dst.to_dict()))
                elapsed = conn.recv()
                asyncio.run(rx.wait(f"r{n}", 30))  # the one result API is async; this loop is not
                if i:
                    times[backend].append(elapsed)
        measure_limits(times, nbytes, reps)  # limits bracket the transfers they bound
        memcpy, sock = gbps(nbytes, times["memcpy"]), gbps(nbytes, times["socket"])
        for backend in backends:
            limit_name, limit = ("memcpy", memcpy) if backend == "shm" else ("socket", sock)
            rate, p50_ms = gbps(nbytes, times[backend]), round(statistics.median(times[backend]) * 1e3, 3)
            results.append({
                "backend": backend, "size_mib": size, "gbps": rate, "p50_ms": p50_ms,
                "blocks": nblocks, "limit": limit_name, "limit_gbps": limit, "vs_limit": round(rate / limit, 3),
            })  # fmt: skip
            if not args.json:
                r = results[-1]
                print(
                    f"{backend:5s} {size:4d} MiB  {rate:6.2f} GB/s  p50 {r['p50_ms']:8.3f} ms  "
                    f"{r['vs_limit']:6.1%} of {limit_name} ({limit:.2f} GB/s measured around them)",
                    flush=True,
                )
    # the headline limits: those of the largest size, measured alongside its transfers
    limits_out = {"memcpy_gbps": memcpy, "socket_gbps": sock}
    conn.send(None)
    child.join(10)
    rx.close()
    shm.close()
    if args.json:
        print(json.dumps({"limits": limits_out, "results": results}))
    else:
        print(f"limits at {sizes[-1]} MiB: memcpy {memcpy} GB/s, raw socket {sock} GB/s")


if __name__ == "__main__":
    main()
