"""The router's FastAPI app: OpenAI /v1/completions and /v1/chat/completions over decode nodes.

`Router` holds what a request needs (models, tokenizer pool, cluster view, decode client, admission);
`create_app` wires the endpoints: validate (`validation.py`), start one stream per choice, then answer
whole or as SSE (`responses.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from pdcluster.control.keys import keys_from_config
from pdcluster.control.metrics import CONTENT_TYPE_LATEST, DroppedFramesCollector, render
from pdcluster.router import responses
from pdcluster.router.auth import check_auth, has_key
from pdcluster.router.cluster import NodeSource, RouterCluster
from pdcluster.router.decode_client import DecodeClient, NoCapacity, RequestStream, StreamFailed
from pdcluster.router.errors import APIError, error_body, install_error_handlers, model_not_found
from pdcluster.router.generation import ChoiceRun, TokenLogprob, merge
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    openapi_components,
    parse_body,
    request_body,
)
from pdcluster.router.policies import make_policy
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import ServedModel
from pdcluster.router.validation import (
    Prepared,
    chat_prompt,
    check_request,
    completion_prompt,
    has_text,
    prepare,
)

log = logging.getLogger(__name__)


class Router:
    def __init__(self, settings: RouterSettings, source: NodeSource,
                 registry: CollectorRegistry | None = None) -> None:
        self.models = {name: ServedModel.load(name, path, settings.max_model_len or None)
                       for name, path in settings.served_models()}
        if not self.models:
            raise ValueError("model: the router needs a model directory (tokenizer + config.json)")
        self.settings = settings
        # Tokenizing and templating run here, off the event loop (tokenizers releases the GIL).
        self.pool = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenize")
        self.metrics = RouterMetrics(registry)
        self.policy = make_policy(settings.routing_policy)
        # `pdcluster router` passes its RouterConfig, whose common knobs include cluster_secret.
        keys = keys_from_config(getattr(settings, "cluster_secret", ""), f"router {settings.node_id}")
        self.cluster = RouterCluster(source, load_stale_s=settings.load_stale_s, keys=keys)
        self.decode: DecodeClient | None = None
        self.in_flight = 0
        self.draining = False   # admin drain: new requests get 503, open streams finish (membership.py)
        self.membership: Any = None   # membership.RouterMembership, set by run_router: etcd record, stats, drain
        self.metrics.registry.register(DroppedFramesCollector("pdcluster_router_dropped_frames", self.dropped_frames))

    def dropped_frames(self) -> dict[str, object]:
        """The `DroppedFrames` of the sockets the router receives on: decode nodes' replies, Load reports."""
        sockets = {"load": self.cluster.load_dropped_frames()}
        if self.decode is not None:
            sockets["decode_nodes"] = self.decode.dealers.dropped
        return {k: v for k, v in sockets.items() if v is not None}

    async def start(self) -> None:
        # A source with its own lifecycle (etcd ClusterView) runs inside the server's event loop.
        if callable(getattr(self.cluster.source, "start", None)):
            await self.cluster.source.start()
        await self.cluster.start()
        self.decode = DecodeClient(self.cluster, self.policy, self.settings, self.metrics)
        if self.membership is not None:
            await self.membership.start()

    async def stop(self) -> None:
        if self.membership is not None:
            await self.membership.stop()
        if self.decode is not None:
            self.decode.close()
        await self.cluster.stop()
        if callable(getattr(self.cluster.source, "stop", None)):
            await self.cluster.source.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise model_not_found(name, list(self.models))
        return model

    def context_limit(self, model: ServedModel) -> int:
        """The model's limit, lowered to the largest max_model_len of its serving decode nodes when all say."""
        held = [n.info.capacity.max_model_len for n in self.cluster.candidates("decode", model=model.name)]
        return min(model.info.max_model_len, max(held)) if held and all(held) else model.info.max_model_len

    def admit(self) -> None:
        """Count a request in flight, or refuse it: 503 while draining, 429 at `max_in_flight`."""
        if self.draining:
            self.metrics.requests.labels("unavailable").inc()
            raise APIError(503, f"router {self.settings.node_id} is draining", retry_after=self.settings.retry_after)
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
        deadline = time.time() + self.settings.request_timeout
        streams = [self.decode.stream(prep.prompt_ids, sampling, deadline, prep.model.name)
                   for sampling in prep.sampling]
        for s in streams:
            log.info("request %s admitted: %d prompt tokens, max_tokens %s", s.request_id, len(prep.prompt_ids),
                     s.sampling.get("max_tokens"), extra={"request_id": s.request_id})
        results = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
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
        raise failure

    def runs(self, prep: Prepared, streams: list[RequestStream], arrival: float) -> list[ChoiceRun]:
        return [ChoiceRun(i, s, prep.model.tokenizer, prep.stop, prep.skip_special_tokens, self.metrics, arrival)
                for i, s in enumerate(streams)]

    def count_tokens(self, prep: Prepared, runs: list[ChoiceRun], arrival: float) -> dict[str, int]:
        completion = sum(len(r.stream.output_ids) for r in runs)
        self.metrics.prompt_tokens.inc(len(prep.prompt_ids))
        self.metrics.generation_tokens.inc(completion)
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prep.prompt_ids) + completion}


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: RouterSettings, source: NodeSource, registry: CollectorRegistry | None = None) -> FastAPI:
    router = Router(settings, source, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdcluster router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request bodies the endpoints parse themselves (`parse_body`)."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(openapi_components(list(router.models)))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        decode = router.cluster.candidates("decode")
        status = "draining" if router.draining else "ok" if decode else "no_decode_nodes"
        if not has_key(settings, request):  # probes without a key learn the status only, not the topology
            return {"status": status}
        return {"status": status, "router": settings.node_id,
                "decode_nodes": sorted(n.id for n in decode),
                "prefill_nodes": sorted(n.id for n in router.cluster.candidates("prefill")),
                "models": {name: sorted(n.id for n in router.cluster.candidates("decode", model=name))
                           for name in router.models},
                "in_flight": router.in_flight}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if settings.metrics_require_key:
            check_auth(settings, request)
        return Response(render(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(settings, request)
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "pdcluster",
                                            "root": m.info.path, "max_model_len": router.context_limit(m)}
                                           for m in router.models.values()]}

    @app.post("/v1/completions", openapi_extra=request_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        check_auth(settings, request)
        req: CompletionRequest = await parse_body(request, CompletionRequest, settings.max_body_bytes)
        model = router.model(req.model)
        check_request(settings, req)
        if has_text(req.prompt):
            prompt_ids = await router.off_loop(completion_prompt, model, req)
        else:   # token ids: no tokenizer to run, and a hop through the pool costs more than the check
            prompt_ids = completion_prompt(model, req)
        prep = prepare(settings, model, req, prompt_ids, router.context_limit(model), req.max_tokens, req.logprobs,
                       "prompt")
        return await serve(request, prep, chat=False, want_logprobs=req.logprobs is not None)

    @app.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        check_auth(settings, request)
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
        model = router.model(req.model)
        check_request(settings, req)
        prompt_ids = await router.off_loop(chat_prompt, model, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = prepare(settings, model, req, prompt_ids, router.context_limit(model), max_tokens, logprobs,
                       "messages")
        return await serve(request, prep, chat=True, want_logprobs=req.logprobs)

    async def serve(request: Request, prep: Prepared, chat: bool, want_logprobs: bool) -> Response:
        router.admit()
        arrival = time.monotonic()
        handed_off = False
        try:
            streams = await router.start_streams(prep)
            runs = router.runs(prep, streams, arrival)
            if prep.stream:
                handed_off = True  # the response owns the in-flight count and the streams from here

                def cleanup() -> None:
                    for run in runs:
                        run.stream.abort("client")
                    router.release()

                return responses.SSEResponse(stream_body(prep, runs, chat, want_logprobs, arrival), cleanup)
            return await whole_body(request, prep, runs, chat, want_logprobs, arrival)
        finally:
            if not handed_off:
                router.release()

    async def whole_body(request: Request, prep: Prepared, runs: list[ChoiceRun], chat: bool,
                         want_logprobs: bool, arrival: float) -> Response:
        texts = [""] * len(runs)
        logprobs: list[list[TokenLogprob]] = [[] for _ in runs]
        finish: list[str | None] = [None] * len(runs)

        async def collect() -> None:
            async for delta in merge(runs):
                texts[delta.index] += delta.text
                logprobs[delta.index].extend(delta.logprobs)
                if delta.finish_reason:
                    finish[delta.index] = delta.finish_reason

        task = asyncio.create_task(collect())
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            router.metrics.requests.labels("client_disconnected").inc()
            return Response(status_code=499)
        try:
            task.result()
        except (NoCapacity, StreamFailed) as exc:
            router.metrics.requests.labels("failed").inc()
            raise APIError(503, f"generation failed: {exc}", retry_after=settings.retry_after) from None
        usage = router.count_tokens(prep, runs, arrival)
        router.metrics.requests.labels("ok").inc()
        return JSONResponse(responses.full_body(prep, chat, want_logprobs, texts, logprobs, finish, usage))

    async def stream_body(prep: Prepared, runs: list[ChoiceRun], chat: bool, want_logprobs: bool,
                          arrival: float) -> AsyncIterator[bytes]:
        out = responses.ChunkWriter(prep, len(runs), chat, want_logprobs)
        outcome = "client_disconnected"
        try:
            if chat:
                yield out.roles()
            try:
                async for delta in merge(runs):
                    yield out.delta(delta)
            except (NoCapacity, StreamFailed) as exc:
                outcome = "failed"
                yield responses.sse(error_body(503, f"generation failed: {exc}"))
                yield responses.DONE
                return
            usage = router.count_tokens(prep, runs, arrival)
            if prep.include_usage:
                yield out.usage(usage)
            yield responses.DONE
            outcome = "ok"
        finally:
            router.metrics.requests.labels(outcome).inc()

    return app
