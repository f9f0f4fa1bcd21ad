"""Connecting to etcd and calling it with deadlines; the task helpers the long-lived etcd sessions share.

Every etcd call goes through `etcd_call` (a timeout on each), so a dead etcd can only ever make a call fail.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Awaitable

import aetcd

from pdcluster.control.config import parse_endpoint

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
# Detect a silently dead etcd connection (no FIN/RST) within ~15 s. etcd refuses client pings more
# often than every 5 s (--grpc-keepalive-min-time) and pings without an open stream.
GRPC_OPTIONS = {"grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000}


class EtcdUnavailable(ConnectionError):
    """No configured etcd endpoint answered."""


async def connect(endpoints: list[str], timeout: float = DEFAULT_TIMEOUT) -> aetcd.Client:
    """A client for the first endpoint that answers a read within `timeout`; EtcdUnavailable otherwise."""
    errors = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        client = aetcd.Client(host, port, timeout=timeout, options=GRPC_OPTIONS)
        try:
            await asyncio.wait_for(client.get(b"/pdcluster/"), timeout)
            return client
        except Exception as exc:  # aetcd/grpc raise many types; all mean "not this endpoint now"
            errors.append(f"{endpoint}: {type(exc).__name__}: {exc}")
            await close_quietly(client)
    raise EtcdUnavailable("no etcd endpoint reachable (" + "; ".join(errors) + ")")


async def close_quietly(client: aetcd.Client | None) -> None:
    if client is None:
        return
    try:
        await asyncio.wait_for(client.close(), DEFAULT_TIMEOUT)
    except Exception as exc:
        log.debug("closing etcd client: %r", exc)


async def etcd_call(awaitable: Awaitable[Any], timeout: float) -> Any:
    """Every etcd call goes through here: aetcd's own deadline plus an asyncio one as a backstop."""
    return await asyncio.wait_for(awaitable, timeout)


async def cancel_and_wait(task: asyncio.Future | None, timeout: float = 5.0) -> None:
    """Cancel `task` and wait until it is done.

    Cancels again while it runs: before Python 3.12 `asyncio.wait_for` can swallow a cancellation
    that lands as its inner call completes, and a plain `task.cancel(); await task` then hangs.
    """
    if task is None:
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while not task.done():
        if asyncio.get_running_loop().time() > deadline:
            log.error("task %r ignored cancellation for %.0f s; leaving it", task, timeout)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled() and task.exception() is not None:
        log.debug("task %r ended with %r", task, task.exception())


def backoff(attempt: int, cap: float) -> float:
    """Exponential backoff from 0.2 s up to `cap`, with jitter so a fleet does not retry in lockstep."""
    return min(cap, 0.2 * 2 ** attempt) * random.uniform(0.7, 1.3)
