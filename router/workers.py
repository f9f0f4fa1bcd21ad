"""`pdcluster router --workers N`: N router processes serving one port.

Each worker binds the port itself with SO_REUSEPORT and the kernel spreads new connections over them.
Chosen over a parent that accepts and hands sockets off: no extra hop or single accepting process, a
worker's crash loses only its own connections, and each worker is a complete router (its own etcd view,
decode-node connections, registration `<node_id>-w<i>`, drain and `max_in_flight`, which is therefore per
process). The parent only starts them, passes SIGTERM/SIGINT on (as SIGTERM), and exits when they have: with 0 if all
did, else with the first failure's code, after stopping the others (systemd restarts the set).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import wait
from typing import Any

from pdcluster.router.server import bind_socket
from pdcluster.router.settings import default_router_id

log = logging.getLogger(__name__)


def serve_workers(config: Any) -> int:
    """Run `config.workers` routers on `config.port` until they all exit; the exit code for the command."""
    base_id = config.node_id or default_router_id()
    reserve = bind_socket(config.host, config.port, reuse_port=True)   # port 0: pick one for all workers
    port = reserve.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = []
    for index in range(config.workers):
        worker = dataclasses.replace(config, node_id=f"{base_id}-w{index}", port=port, workers=1)
        procs.append(ctx.Process(target=_worker, args=(worker, os.getpid()), name=worker.node_id))
    for proc in procs:
        proc.start()
    reserve.close()
    log.info("router: %d workers on port %d (%s-w0..w%d)", len(procs), port, base_id, len(procs) - 1)
    stopping = False

    def forward(_signum: int, _frame: Any) -> None:
        # Always as SIGTERM: a terminal's Ctrl-C reaches the workers too, and a second SIGINT would make
        # uvicorn drop its open streams instead of finishing them.
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = 0
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        for proc in [p for p in running if not p.is_alive()]:
            running.remove(proc)
            proc.join()
            if proc.exitcode and not stopping:
                log.error("router worker %s exited with %s; stopping the others", proc.name, proc.exitcode)
                code = code or 1
                forward(signal.SIGTERM, None)
    return code


def _worker(config: Any, parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG: end with the parent, even a SIGKILLed one
    if os.getppid() != parent_pid:
        return
    from pdcluster.control.log import setup_logging
    from pdcluster.router.server import run_router

    setup_logging(getattr(config, "log_level", "INFO"), getattr(config, "log_format", "text"), config.node_id)
    run_router(config, reuse_port=True)
