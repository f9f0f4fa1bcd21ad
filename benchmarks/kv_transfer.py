"""KV transfer throughput and latency between two processes, next to this machine's physical limits.

    .venv/bin/python benchmarks/kv_transfer.py [--json] [--backends shm,tcp,gloo] [--sizes 1,4,16,256]
    .venv/bin/python benchmarks/kv_transfer.py --int8-greedy   # effect of int8 wire compression on greedy output

The receiver (decode side) runs in this process with its pool in POSIX shm; the sender (prefill side)
is a spawned process. Times are sender-side, start() → finish() returned (the receiver has verified
the checksum and acknowledged). Block: 16 layers × 2 × 16 tokens × 2 KV heads × 128 × bf16 = 256 KiB,
so 4 MiB is the "16-block transfer" of the latency target. Limits, measured in the same run:
memcpy = torch copy_ into a preallocated buffer; socket = raw sendall → recv_into over loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kv_transfer import KVReceiver, KVSender, SharedKVPool  # noqa: E402

BLOCK = (16, 2, 16, 2, 128)  # layers, k/v, block_size, kv heads, head_dim
BLOCK_BYTES = 16 * 2 * 16 * 2 * 128 * 2
DTYPE = torch.bfloat16


def reps_for(size_mib: int) -> int:
    return max(5, min(200, 512 // size_mib))


def _sender_main(conn, num_blocks: int) -> None:
    pool = torch.randn((num_blocks, *BLOCK)).to(DTYPE)
    senders: dict[tuple[str, int], KVSender] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "socket":
            _, port, nbytes, reps = msg
            buf = memoryview(bytearray(nbytes))
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(reps + 1):
                    s.sendall(buf)
                    s.recv(1)
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


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def socket_gbps(conn, nbytes: int, reps: int) -> float:
    """Child sendall's nbytes, we recv_into a preallocated buffer and answer one byte (ping-pong)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    conn.send(("socket", lsock.getsockname()[1], nbytes, reps))
    s, _ = lsock.accept()
    buf = memoryview(bytearray(nbytes))
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += s.recv_into(buf[got:])
        s.sendall(b"k")
        if i:
            times.append(time.perf_counter() - t0)
    s.close()
    lsock.close()
    return nbytes * len(times) / sum(times) / 1e9


def int8_greedy(num_prompts: int = 16, max_tokens: int = 32) -> dict:
    """Greedy tokens of a tiny random model, prompt KV exact vs round-tripped through int8 (as a decode
    node would receive it with quant="int8"): the first token comes from prefill, the rest from decode."""
    import tempfile

    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.testing import make_tiny_model
    from kv_transfer import quant

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, dtype in (("llama", "float32"), ("qwen2", "bfloat16")):
            path = make_tiny_model(f"{tmp}/{arch}", arch=arch, num_key_value_heads=2)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 400, (int(n),), generator=g).tolist() for n in torch.randint(8, 48, (num_prompts,), generator=g)]
            runs = []
            for lossy in (False, True):
                eng = LLMEngine.from_args(path, dtype=dtype, kv_cache_memory=64 << 20, max_num_batched_tokens=4096)
                for i, p in enumerate(prompts):
                    eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                toks: dict[str, list[int]] = {}
                first = True
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        toks[o.request_id] = list(o.outputs[0].token_ids)
                    if first and lossy:  # prompt KV is all in the pool now: pass it through the wire format
                        pool = eng.kv_pool.tensor
                        pool.copy_(quant.dequantize(quant.quantize(pool), tuple(pool.shape), pool.dtype))
                    first = False
                runs.append([toks[f"r{i}"] for i in range(num_prompts)])
            exact, lossy_toks = runs
            same_tokens = sum(a == b for x, y in zip(exact, lossy_toks) for a, b in zip(x, y))
            out[f"{arch}-{dtype}"] = {
                "prompts": num_prompts, "max_tokens": max_tokens,
                "identical_sequences": sum(x == y for x, y in zip(exact, lossy_toks)),
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

    shm = SharedKVPool.create((max_blocks, *BLOCK), DTYPE)
    rx = KVReceiver(shm.tensor, shm_name=shm.name)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_sender_main, args=(child_conn, max_blocks), daemon=True)
    child.start()

    big = max(sizes) * (1 << 20)
    limits = {"memcpy_gbps": round(memcpy_gbps(big, 5), 2), "socket_gbps": round(socket_gbps(conn, big, 5), 2)}
    results = []
    n = 0
    for backend in args.backends.split(","):
        for size in sizes:
            nblocks = size * (1 << 20) // BLOCK_BYTES
            times = []
            for i in range(reps_for(size) + 1):
                n += 1
                dst = rx.reserve(f"r{n}", list(range(nblocks)))
                conn.send(("xfer", backend, args.streams, dst.to_dict()))
                times.append(conn.recv())
                rx.wait_blocking(f"r{n}", 30)
            times = times[1:]  # the first one connects
            results.append({
                "backend": backend, "size_mib": size, "gbps": round(nblocks * BLOCK_BYTES * len(times) / sum(times) / 1e9, 2),
                "p50_ms": round(statistics.median(times) * 1e3, 3), "blocks": nblocks,
            })  # fmt: skip
            if not args.json:
                r = results[-1]
                print(f"{backend:5s} {size:4d} MiB  {r['gbps']:6.2f} GB/s  p50 {r['p50_ms']:8.3f} ms", flush=True)
    conn.send(None)
    child.join(10)
    rx.close()
    shm.close()
    if args.json:
        print(json.dumps({"limits": limits, "results": results}))
    else:
        print(f"limits: memcpy {limits['memcpy_gbps']} GB/s, raw socket {limits['socket_gbps']} GB/s")


if __name__ == "__main__":
    main()
