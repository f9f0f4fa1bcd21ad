"""`Router`: what serving a request needs, without HTTP: the served models, a tokenizer pool, the cluster view,
the decode client, admission (`in_flight`) and the metrics. The endpoints are `app.RouterAPI`'s."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, TypeVar

from prometheus_client import CollectorRegistry

from pdcluster.control.keys import ClusterKeys
from pdcluster.control.metrics import DroppedFramesCollector
from pdcluster.control.threads import started_pool
from pdcluster.router.cluster import NodeSource, RouterCluster
from pdcluster.router.decode_client import DecodeClient, InvalidRequest, NoCapacity, RequestStream, StreamFailed
from pdcluster.router.errors import APIError, model_not_found
from pdcluster.router.generation import ChoiceRun, Echo
from pdcluster.router.lora import LoraRegistry
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policies import RoutingPolicy, make_policy
from pdcluster.router.prefix_index import PrefixIndexCollector
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import ServedModel
from pdcluster.router.validation import Prepared

log = logging.getLogger(__name__)

T = TypeVar("T")


class Router:
    """Owns the in-flight count and the decode client (made by `start`, on the server's event loop)."""

    def __init__(self, settings: RouterSettings, models: dict[str, ServedModel], cluster: RouterCluster,
                 policy: RoutingPolicy, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.models = models
        self.cluster = cluster
        self.policy = policy
        self.metrics = metrics
        # Tokenizing and templating run here, off the event loop (tokenizers releases the GIL).
        self.pool = started_pool(settings.tokenizer_threads, "tokenize")
        self.decode: DecodeClient | None = None
        self.loras = LoraRegistry(cluster, models)
        self.in_flight = 0
        metrics.registry.register(DroppedFramesCollector("pdcluster_router_dropped_frames", self.dropped_frames))
        metrics.registry.register(PrefixIndexCollector(lambda: cluster.nodes("prefill") + cluster.nodes("decode")))

    def dropped_frames(self) -> dict[str, object]:
        """The `DroppedFrames` of the sockets the router receives on: decode nodes' replies, Load reports."""
        sockets = {"load": self.cluster.load_dropped_frames()}
        if self.decode is not None:
            sockets["decode_nodes"] = self.decode.dealers.dropped
        return {k: v for k, v in sockets.items() if v is not None}

    @property
    def open_streams(self) -> int:
        """Token streams open to decode nodes (one per attempt of a choice being generated)."""
        return len(self.decode.queues) if self.decode is not None else 0

    @property
    def tokens_received(self) -> int:
        """Generated tokens received from decode nodes since start (`DecodeClient.tokens_received`)."""
        return self.decode.tokens_received if self.decode is not None else 0

    async def start(self) -> None:
        # A source with its own lifecycle (etcd ClusterView) runs inside the server's event loop.
        start = getattr(self.cluster.source, "start", None)
        if start is not None:
            await start()
        await self.cluster.start()
        self.decode = DecodeClient(self.cluster, self.policy, self.settings, self.metrics)

    async def stop(self) -> None:
        if self.decode is not None:
            self.decode.close()
        await self.cluster.stop()
        stop = getattr(self.cluster.source, "stop", None)
        if stop is not None:
            await stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def model(self, name: str) -> ServedModel:
        """A served model, or a LoRA adapter as a view of its base model (router/lora.py); 404 otherwise."""
        model = self.models.get(name) or self.loras.view(name)
        if model is None:
            raise model_not_found(name, list(self.models) + [a.name for a in self.loras.listed()])
        return model

    def context_limit(self, model: ServedModel) -> int:
        """The model's limit, lowered to the largest max_model_len of its serving decode nodes when all say."""
        held = [n.info.capacity.max_model_len for n in self.cluster.candidates("decode", model=model.node_model)]
        return min(model.info.max_model_len, max(held)) if held and all(held) else model.info.max_model_len

    def admit(self) -> None:
        """Count a request in flight, or refuse it: 429 at `max_in_flight`."""
        if self.in_flight >= self.settings.max_in_flight:
            self.metrics.requests.labels("overloaded").inc()
            raise APIError(429, "too many requests in flight", retry_after=self.settings.retry_after)
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    async def start_streams(self, prep: Prepared) -> list[RequestStream]:
        assert self.decode is not None, "router not started"
        deadline = time.monotonic() + self.settings.request_timeout
        streams = [self.decode.stream(prep.prompt_ids, sampling, deadline, prep.model.node_model, prep.model.adapter)
                   for sampling in prep.sampling]
        for s in streams:
            log.info("request %s admitted: %d prompt tokens, max_tokens %s", s.request_id, len(prep.prompt_ids),
                     s.sampling.get("max_tokens"), extra={"request_id": s.request_id})
        try:
            results = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
        except asyncio.CancelledError:   # the client left (waiting for a decode node, or for the first tokens)
            for s in streams:
                s.abort("client")
            raise
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return streams
        for s in streams:
            s.abort("failed_start")
            log.info("request %s failed to start: %s", s.request_id, failure, extra={"request_id": s.request_id})
        if isinstance(failure, NoCapacity):
            self.metrics.requests.labels("overloaded" if failure.overloaded else "unavailable").inc()
            status = 429 if failure.overloaded else 503
            raise APIError(status, f"no decode node can take the request now: {failure}",
                           retry_after=failure.retry_after)
        if isinstance(failure, StreamFailed):
            self.metrics.requests.labels("failed").inc()
            raise APIError(503, str(failure), retry_after=self.settings.retry_after)
        if isinstance(failure, InvalidRequest):
            self.metrics.requests.labels("invalid").inc()
            raise APIError(400, str(failure), code="invalid_request")
        raise failure

    def runs(self, prep: Prepared, streams: list[RequestStream], arrival: float) -> list[ChoiceRun]:
        echo = None
        if prep.echo is not None:
            echo = Echo(prep.echo, prep.sampling[0]["logprobs"], prep.echo_only)
        return [ChoiceRun(i, s, prep.model.tokenizer, prep.stop, prep.skip_special_tokens, self.metrics, arrival,
                          echo, prep.prompt_logprobs) for i, s in enumerate(streams)]

    def count_tokens(self, prep: Prepared, runs: list[ChoiceRun], arrival: float) -> dict[str, int]:
        completion = 0 if prep.echo_only else sum(len(r.stream.output_ids) for r in runs)
        self.metrics.prompt_tokens.inc(len(prep.prompt_ids))
        self.metrics.generation_tokens.inc(completion)
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prep.prompt_ids) + completion}


def build_router(settings: RouterSettings, source: NodeSource, registry: CollectorRegistry | None = None,
                 keys: ClusterKeys | None = None) -> Router:
    """A `Router` for `settings`: its models loaded, its cluster view on `source` (`keys`: the cluster secret's,
    for CURVE to the nodes; None: unauthenticated), its metrics on `registry` (None: a new one)."""
    models = {name: ServedModel.load(name, path, settings.max_model_len or None)
              for name, path in settings.served_models()}
    if not models:
        raise ValueError("model: the router needs a model directory (tokenizer + config.json)")
    cluster = RouterCluster(source, load_stale_s=settings.load_stale_s, keys=keys)
    return Router(settings, models, cluster, make_policy(settings.routing_policy), RouterMetrics(registry))
