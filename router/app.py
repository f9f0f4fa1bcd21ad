"""The router's FastAPI app: OpenAI /v1/completions and /v1/chat/completions over decode nodes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from pdcluster.control.metrics import CONTENT_TYPE_LATEST, DroppedFramesCollector, render
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.router.cluster import NodeSource, RouterCluster
from pdcluster.router.decode_client import DecodeClient, NoCapacity, RequestStream, StreamFailed
from pdcluster.router.errors import APIError, bad_request, error_body, install_error_handlers
from pdcluster.router.generation import ChoiceDelta, ChoiceRun, TokenLogprob, merge
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.router.policies import make_policy
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import ModelInfo, Tokenizer, read_model_info

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request, ready to send: what both endpoints share."""

    prompt_ids: list[int]
    sampling: list[dict[str, Any]]  # one engine request per choice
    stop: list[str]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool


class Router:
    def __init__(self, settings: RouterSettings, source: NodeSource,
                 registry: CollectorRegistry | None = None) -> None:
        if not settings.model:
            raise ValueError("model: the router needs the model directory (tokenizer + config.json)")
        self.settings = settings
        self.tokenizer = Tokenizer(settings.model)
        self.model: ModelInfo = read_model_info(settings.model, settings.served_model_name or None,
                                                settings.max_model_len or None)
        self.metrics = RouterMetrics(registry)
        self.policy = make_policy(settings.routing_policy)
        self.cluster = RouterCluster(source, load_stale_s=settings.load_stale_s)
        self.decode: DecodeClient | None = None
        self.in_flight = 0
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

    async def stop(self) -> None:
        if self.decode is not None:
            self.decode.close()
        await self.cluster.stop()
        if callable(getattr(self.cluster.source, "stop", None)):
            await self.cluster.source.stop()

    # -- request preparation

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise bad_request(f"The model '{name}' does not exist; this router serves '{self.model.name}'",
                              param="model", code="model_not_found")

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request",
                                  param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.check_ids(prompt, "prompt")

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param=param)
        return list(ids)

    def prepare(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                max_tokens: int | None, logprobs: int | None, prompt_param: str) -> Prepared:
        limit = self.model.max_model_len
        if not prompt_ids:
            raise bad_request("the prompt is empty", param=prompt_param)
        if len(prompt_ids) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                              f"{len(prompt_ids)} tokens", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        if isinstance(max_tokens, int) and max_tokens >= 1 and len(prompt_ids) + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                              f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                              f"{max_tokens} for the completion)", param="max_tokens",
                              code="context_length_exceeded")
        if not 1 <= req.n <= self.settings.max_n:
            raise bad_request(f"n must be in [1, {self.settings.max_n}], got {req.n}", param="n")
        kwargs = req.sampling_kwargs()
        kwargs.update(max_tokens=max_tokens, logprobs=logprobs)
        if req.stop_token_ids:
            self.check_ids(req.stop_token_ids, "stop_token_ids")
        try:
            base = SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None
        per_choice = []
        for i in range(req.n):
            d = base.to_dict()
            d["n"] = 1
            if base.seed is not None:
                d["seed"] = base.seed + i
            per_choice.append(d)
        return Prepared(prompt_ids=prompt_ids, sampling=per_choice, stop=list(base.stop),
                        skip_special_tokens=base.skip_special_tokens, stream=req.stream,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage))

    # -- running

    async def start_streams(self, prep: Prepared) -> list[RequestStream]:
        assert self.decode is not None, "router not started"
        deadline = time.time() + self.settings.request_timeout
        streams = [self.decode.stream(prep.prompt_ids, sampling, deadline) for sampling in prep.sampling]
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
        return [ChoiceRun(i, s, self.tokenizer, prep.stop, prep.skip_special_tokens, self.metrics, arrival)
                for i, s in enumerate(streams)]

    def count_tokens(self, prep: Prepared, runs: list[ChoiceRun], arrival: float) -> dict[str, int]:
        completion = sum(len(r.stream.output_ids) for r in runs)
        self.metrics.prompt_tokens.inc(len(prep.prompt_ids))
        self.metrics.generation_tokens.inc(completion)
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prep.prompt_ids) + completion}

    # -- OpenAI formatting

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [self.tokenizer.token_text(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.tokenizer.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        tt, tb = self.tokenizer.token_text, self.tokenizer.token_bytes
        return [{"token": tt(lp.token_id), "logprob": lp.logprob, "bytes": tb(lp.token_id),
                 "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": tb(t)} for t, v in lp.top]}
                for lp in lps]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _parse(request: Request, model: type) -> Any:
    body = await request.body()
    return model.model_validate_json(body or b"{}")  # ValidationError -> 400 via the handlers


def _check_auth(router: Router, request: Request) -> None:
    key = router.settings.api_key
    if key and request.headers.get("authorization", "") != f"Bearer {key}":
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        decode = router.cluster.candidates("decode")
        return {"status": "ok" if decode else "no_decode_nodes", "router": settings.node_id,
                "decode_nodes": sorted(n.id for n in decode),
                "prefill_nodes": sorted(n.id for n in router.cluster.candidates("prefill")),
                "in_flight": router.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_auth(router, request)
        return {"object": "list", "data": [{"id": router.model.name, "object": "model", "created": 0,
                                            "owned_by": "pdcluster", "root": router.model.path,
                                            "max_model_len": router.model.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(router, request)
        req: CompletionRequest = await _parse(request, CompletionRequest)
        router.check_model(req.model)
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        prep = router.prepare(req, router.completion_prompt(req), req.max_tokens, req.logprobs, "prompt")
        return await serve(request, prep, chat=False, want_logprobs=req.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_auth(router, request)
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        router.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        try:
            prompt_ids = router.tokenizer.apply_chat_template([m.template_dict() for m in req.messages])
        except Exception as exc:  # template errors (bad roles, missing fields) are the client's
            raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = router.prepare(req, prompt_ids, max_tokens, logprobs, "messages")
        return await serve(request, prep, chat=True, want_logprobs=req.logprobs)

    async def serve(request: Request, prep: Prepared, chat: bool, want_logprobs: bool) -> Response:
        if router.in_flight >= settings.max_in_flight:
            router.metrics.requests.labels("overloaded").inc()
            raise APIError(429, "too many requests in flight", retry_after=settings.retry_after)
        arrival = time.monotonic()
        router.in_flight += 1
        router.metrics.in_flight.inc()
        done = False
        try:
            streams = await router.start_streams(prep)
            runs = router.runs(prep, streams, arrival)
            if prep.stream:
                done = True  # the response owns the in-flight count and the streams from here

                def cleanup() -> None:
                    for run in runs:
                        run.stream.abort("client")
                    router.in_flight -= 1
                    router.metrics.in_flight.dec()

                return _SSEResponse(stream_body(prep, runs, chat, want_logprobs, arrival), cleanup)
            return await full_body(request, prep, runs, chat, want_logprobs, arrival)
        finally:
            if not done:
                router.in_flight -= 1
                router.metrics.in_flight.dec()

    async def full_body(request: Request, prep: Prepared, runs: list[ChoiceRun], chat: bool,
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
        created = int(time.time())
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": {"content": router.chat_logprobs(logprobs[i]), "refusal": None}
                        if want_logprobs else None,
                        "finish_reason": finish[i]} for i in range(len(runs))]
            return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                 "created": created, "model": router.model.name, "choices": choices,
                                 "usage": usage})
        choices = [{"index": i, "text": texts[i],
                    "logprobs": router.completion_logprobs(logprobs[i], 0) if want_logprobs else None,
                    "finish_reason": finish[i]} for i in range(len(runs))]
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
                             "model": router.model.name, "choices": choices, "usage": usage})

    async def stream_body(prep: Prepared, runs: list[ChoiceRun], chat: bool, want_logprobs: bool,
                          arrival: float) -> AsyncIterator[str]:
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": router.model.name}
        offsets = [0] * len(runs)
        outcome = "client_disconnected"

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> str:
            body = dict(head, choices=choices)
            if prep.include_usage:
                body["usage"] = usage
            return _sse(body)

        def choice(delta: ChoiceDelta) -> dict[str, Any]:
            if chat:
                lp = ({"content": router.chat_logprobs(delta.logprobs), "refusal": None}
                      if want_logprobs and delta.logprobs else None)
                content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
                return {"index": delta.index, "delta": content, "logprobs": lp,
                        "finish_reason": delta.finish_reason}
            lp = router.completion_logprobs(delta.logprobs, offsets[delta.index]) if want_logprobs else None
            offsets[delta.index] += len(delta.text)
            return {"index": delta.index, "text": delta.text, "logprobs": lp,
                    "finish_reason": delta.finish_reason}

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(runs))])
            try:
                async for delta in merge(runs):
                    yield chunk([choice(delta)])
            except (NoCapacity, StreamFailed) as exc:
                outcome = "failed"
                yield _sse(error_body(503, f"generation failed: {exc}"))
                yield "data: [DONE]\n\n"
                return
            usage = router.count_tokens(prep, runs, arrival)
            if prep.include_usage:
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
            outcome = "ok"
        finally:
            router.metrics.requests.labels(outcome).inc()

    return app


class _SSEResponse(StreamingResponse):
    """An SSE response that releases its request even when the body generator never started
    (the client left before the first byte): `cleanup` runs exactly once, however it ends."""

    def __init__(self, body: AsyncIterator[str], cleanup: Any) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
