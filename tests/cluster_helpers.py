"""What the process-level tests share: reading the nodes' /metrics, waiting (always with a deadline) until
every node is idle with its KV pool empty again, the openai client, one greedy request and the etcd view."""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field

import openai

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster


def node_metrics(cluster: LocalCluster, kind: str) -> dict[str, dict[str, float]]:
    """{node_id: /metrics samples} of the live nodes of one kind."""
    return {s.node_id: scrape_metrics(s.metrics_url) for s in cluster.services if s.kind == kind and s.alive}


def all_node_metrics(cluster: LocalCluster) -> dict[str, dict[str, float]]:
    return {**node_metrics(cluster, "prefill"), **node_metrics(cluster, "decode")}


def total(metrics: dict[str, dict[str, float]], key: str) -> float:
    """Sum of one sample over nodes; a key ending in "{" sums every label set of that metric."""
    if key.endswith("{"):
        return sum(v for m in metrics.values() for k, v in m.items() if k.startswith(key))
    return sum(m.get(key, 0.0) for m in metrics.values())


def router_metrics(cluster: LocalCluster) -> dict[str, float]:
    return scrape_metrics(cluster.url + "/metrics")


def wait_idle(cluster: LocalCluster, timeout: float = 20.0) -> dict[str, dict[str, float]]:
    """Until every live node runs nothing and its KV pool has 0 blocks used and 0 reserved (docs/design.md §7
    invariant); its metrics then. Fails with the busy nodes' numbers after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = all_node_metrics(cluster)
        busy = {n: {k.removeprefix("pdcluster_node_"): v for k, v in m.items() if k in IDLE_GAUGES}
                for n, m in metrics.items() if any(m[k] for k in IDLE_GAUGES)}
        if not busy:
            return metrics
        assert time.monotonic() < deadline, f"nodes not idle / KV blocks not all free: {busy}"
        time.sleep(0.2)


IDLE_GAUGES = ("pdcluster_node_kv_blocks_used", "pdcluster_node_kv_blocks_reserved",
               "pdcluster_node_requests_in_flight", "pdcluster_node_running_requests",
               "pdcluster_node_waiting_requests")


def client(cluster: LocalCluster, timeout: float = 60.0) -> openai.AsyncOpenAI:
    """The official client; no retries of its own (a failed request must show), every call bounded."""
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=timeout)


@dataclass
class Completion:
    text: str = ""
    tokens: list[str] = field(default_factory=list)   # per generated token (logprobs), to compare token by token
    finish: str | None = None
    usage: int = 0
    chunk_times: list[float] = field(default_factory=list)   # monotonic arrival of each streamed chunk
    ended: float = 0.0   # monotonic time the response was complete


async def complete(api: openai.AsyncOpenAI, model: str, prompt: list[int] | str, max_tokens: int,
                   stream: bool = True, progress: list[int] | None = None, slot: int = 0) -> Completion:
    """One greedy completion with ignore_eos (exactly max_tokens tokens); `progress[slot]` counts the chunks
    seen so far, so a drill can strike once every stream is under way."""
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
    out = Completion()
    if not stream:
        r = await api.completions.create(**kwargs)
        choice = r.choices[0]
        return Completion(choice.text, list(choice.logprobs.tokens), choice.finish_reason, r.usage.completion_tokens,
                          ended=time.monotonic())
    async for chunk in await api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            choice = chunk.choices[0]
            out.text += choice.text
            out.tokens += choice.logprobs.tokens if choice.logprobs else []
            out.finish = choice.finish_reason or out.finish
            out.chunk_times.append(time.monotonic())
            if progress is not None:
                progress[slot] += 1
        if chunk.usage:
            out.usage = chunk.usage.completion_tokens
    out.ended = time.monotonic()
    return out


async def bounded(aws, timeout: float) -> list:
    """gather with a deadline: a drill never hangs on a request that does not end."""
    return await asyncio.wait_for(asyncio.gather(*aws), timeout)


async def registered_nodes(cluster: LocalCluster) -> set[str]:
    """Node ids registered in etcd right now."""
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import list_nodes

    etcd = await connect([cluster.etcd])
    try:
        return {n.node_id for n in await list_nodes(etcd, cluster.cluster)}
    finally:
        await close_quietly(etcd)


async def wait_until_async(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll a predicate (plain or async) until it returns something truthy (returned); fail with `what` at the
    deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} (not within {timeout:.0f} s)"
        await asyncio.sleep(interval)
