"""CPU cost of CURVE on the control plane's small frames: a DEALER sends `Tokens`-sized frames to a ROUTER,
plain vs CURVE (the cluster secret's keys); reports frames/s and µs of CPU (all threads of the process, both
ends) per frame. Two ways: through pdcluster's asyncio transport (what a node and a router do: encode, send,
recv, decode), and raw (libzmq only: sync sockets, the same bytes, no Python per frame beyond the call).

    python benchmarks/zmq_curve.py [--frames 200000] [--ids 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from pdcluster.control.keys import generate_secret
from pdcluster.control.protocol import Tokens, encode
from pdcluster.control.transport import DealerClient, RouterServer


async def run(keys, frames: int, ids: int) -> tuple[float, float, int]:
    server = RouterServer(hwm=frames + 10, keys=keys)
    address = server.bind("tcp://127.0.0.1:0")
    client = DealerClient(hwm=frames + 10, keys=keys)
    client.connect(address)
    msg = Tokens(rid="cmpl-0123456789abcdef.0", ids=list(range(1000, 1000 + ids)), pos=0)
    client.send(msg)
    await server.recv()   # the handshake is done
    wall, cpu = time.perf_counter(), time.process_time()
    got = 0
    while got < frames:
        batch = min(1000, frames - got)
        for _ in range(batch):
            client.send(msg)
        for _ in range(batch):
            await server.recv()
        got += batch
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    client.close()
    server.close()
    return frames / wall, cpu / frames * 1e6, len(encode(msg))


def run_raw(keys, frames: int, ids: int) -> tuple[float, float, int]:
    import zmq

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (server, client):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    if keys is not None:
        server.curve_secretkey, server.curve_publickey, server.curve_server = keys.server_secret, keys.server_public, 1
        client.curve_serverkey = keys.server_public
        client.curve_publickey, client.curve_secretkey = keys.client_public, keys.client_secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    frame = encode(Tokens(rid="cmpl-0123456789abcdef.0", ids=list(range(1000, 1000 + ids)), pos=0))
    client.send(frame)
    server.recv_multipart()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(frames):
        client.send(frame, copy=False)
    for _ in range(frames):
        server.recv_multipart(copy=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ctx.destroy(linger=0)
    return frames / wall, cpu / frames * 1e6, len(frame)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--ids", type=int, default=1, help="token ids per frame")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = generate_secret(Path(tmp) / "secret")
    for way in ("transport", "raw"):
        for name, k in (("plain", None), ("curve", keys), ("plain", None), ("curve", keys)):
            rate, cpu_us, size = asyncio.run(run(k, args.frames, args.ids)) if way == "transport" else \
                run_raw(k, args.frames, args.ids)
            print(f"{way:9s} {name:5s} {size:4d}-byte frames: {rate:9.0f} frames/s, {cpu_us:6.2f} µs CPU per frame")


if __name__ == "__main__":
    main()
