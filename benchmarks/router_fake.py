"""The router alone, for `serving.py --start fake`: a fake decode node and the router, each in its own process.

The fake node steps like an engine: every `step_s` each running request gets one token, sent as one
`TokenBatch` per router per step (or one `Tokens` per request with code that predates `TokenBatch`, so
the previous commit's router can be measured by the same script; `serving.py --baseline`).
"""

from __future__ import annotations

import asyncio
import cProfile
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("PDCLUSTER_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))


def fake_decode_node(conn: Any, secret: str, step_s: float) -> None:
    asyncio.run(_fake_decode_node(conn, secret, step_s))


async def _fake_decode_node(conn: Any, secret: str, step_s: float) -> None:
    from pdcluster.control import protocol
    from pdcluster.control.keys import load_secret
    from pdcluster.control.protocol import Abort, Generate, Tokens
    from pdcluster.control.transport import RouterServer

    batch_type = getattr(protocol, "TokenBatch", None)
    server = RouterServer(keys=load_secret(secret))
    conn.send(server.bind("tcp://127.0.0.1:0"))
    active: dict[str, list[Any]] = {}   # rid -> [identity, position, max_tokens, prompt length]

    async def receive() -> None:
        while True:
            identity, msg = await server.recv()
            if isinstance(msg, Generate):
                active[msg.rid] = [identity, 0, int(msg.sampling.get("max_tokens", 16)), len(msg.prompt_ids)]
            elif isinstance(msg, Abort):
                active.pop(msg.rid, None)

    task = asyncio.create_task(receive())
    loop = asyncio.get_running_loop()
    next_step = loop.time()
    while True:   # steps at a fixed rate: the time a step takes here does not stretch the interval
        next_step = max(next_step + step_s, loop.time())
        await asyncio.sleep(next_step - loop.time())
        per_router: dict[bytes, list[Tokens]] = {}
        for rid, req in list(active.items()):
            identity, pos, limit, plen = req
            finish = "length" if pos + 1 >= limit else None
            per_router.setdefault(identity, []).append(Tokens(
                rid=rid, ids=[(7 + pos) % 300 + 3], finish=finish, pos=pos, num_prompt_tokens=plen if pos == 0 else 0,
                prefill_path="local" if pos == 0 else ""))
            req[1] = pos + 1
            if finish:
                del active[rid]
        for identity, items in per_router.items():
            if batch_type is not None:
                server.send(identity, batch_type(items=items))
            else:
                for item in items:
                    server.send(identity, item)
        if task.done():
            task.result()


def router_process(model: str, secret: str, node_addr: str, port_conn: Any, profile: str, index: int = 0,
                   reuse_port: bool = False) -> None:
    from pdcluster.control.records import NodeInfo
    from pdcluster.router.cluster import StaticNodeSource
    from pdcluster.router.server import run_router
    from pdcluster.router.settings import RouterConfig

    settings = RouterConfig(model=model, host="127.0.0.1", port=port_conn, node_id=f"bench-router-w{index}",
                            disagg_min_tokens=0, max_in_flight=100000, cluster_secret=secret)
    source = StaticNodeSource([NodeInfo(node_id="fake-decode", role="decode", model=settings.served_models()[0][0],
                                        control_addr=node_addr)])
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    try:
        run_router(settings, source, reuse_port) if reuse_port else run_router(settings, source)   # older trees
    except KeyboardInterrupt:   # the benchmark's stop
        pass
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)


class FakeSetup:
    """Starts the fake decode node and `workers` router processes serving `model` on one port (SO_REUSEPORT,
    as `pdcluster router --workers N`); `url` once started."""

    def __init__(self, model: str, step_s: float, profile: str = "", workers: int = 1, pin: bool = False) -> None:
        from pdcluster.control.keys import generate_secret

        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdcluster-bench-{os.getpid()}"
        self.dir.mkdir(exist_ok=True)
        self.secret = str(self.dir / "cluster.secret")
        generate_secret(self.secret, force=True)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.node = ctx.Process(target=fake_decode_node, args=(child, self.secret, step_s), daemon=True)
        self.node.start()
        node_addr = parent.recv()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.routers = [ctx.Process(target=router_process, args=(model, self.secret, node_addr, port,
                                                                 profile if i == 0 else "", i, workers > 1))
                        for i in range(workers)]
        for router in self.routers:
            router.start()
        if pin:   # the routers on CPUs of their own, the fake node and the load generator (this process) on the rest
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) <= workers:
                raise SystemExit(f"--pin-router: {len(cpus)} CPUs cannot give {workers} router(s) CPUs of their own")
            for router in self.routers:
                os.sched_setaffinity(router.pid, cpus[:workers])
            os.sched_setaffinity(self.node.pid, cpus[workers:])
            os.sched_setaffinity(0, cpus[workers:])

    def wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1.0).json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError("the benchmark's router did not become ready")

    def cpu_seconds(self) -> float:
        """CPU time the router processes used so far (user + system): what a token costs on a shared machine."""
        import psutil

        return sum(sum(psutil.Process(r.pid).cpu_times()[:2]) for r in self.routers)

    def stop(self) -> None:
        for router in self.routers:
            if router.is_alive():
                os.kill(router.pid, 2)   # SIGINT: uvicorn shuts down, re-raises it; the profile is written
        for router in self.routers:
            router.join(15)
        for proc in (*self.routers, self.node):
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()
