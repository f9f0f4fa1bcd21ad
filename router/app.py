"""The router's FastAPI app: OpenAI /v1/completions and /v1/chat/completions over decode nodes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from pdcluster.control.keys import keys_from_config
from pdcluster.control.metrics import CONTENT_TYPE_LATEST, DroppedFramesCollector, render
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.router.cluster import NodeSource, RouterCluster
from pdcluster.router.decode_client import DecodeClient, NoCapacity, RequestStream, StreamFailed
from pdcluster.router.errors import APIError, bad_request, error_body, install_error_handlers, model_not_found
from pdcluster.router.generation import ChoiceDelta, ChoiceRun, TokenLogprob, merge
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
from pdcluster.router.tokenizer import ServedModel, Tokenizer

log = logging.getLogger(__name__)
_INT64 = 1 << 64


@dataclass
class Prepared:
    """A validated request, ready to send: what both endpoints share."""

    model: ServedModel
    prompt_ids: list[int]
    sampling: list[dict[str, Any]]  # one engine request per choice
    stop: list[str]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool


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

    # -- request preparation

    def model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise model_not_found(name, list(self.models))
        return model

    def context_limit(self, model: ServedModel) -> int:
        """The model's limit, lowered to the largest max_model_len of its serving decode nodes when all say."""
        held = [n.info.capacity.max_model_len for n in self.cluster.candidates("decode", model=model.name)]
        return min(model.info.max_model_len, max(held)) if held and all(held) else model.info.max_model_len

    def completion_prompt(self, model: ServedModel, req: CompletionRequest) -> list[int]:
        """Token ids of the prompt (runs on the tokenizer pool)."""
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request",
                                  param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return model.tokenizer.encode(prompt)
        return self.check_ids(model, prompt, "prompt")

    def chat_prompt(self, model: ServedModel, req: ChatCompletionRequest) -> list[int]:
        """Token ids of the rendered chat template (runs on the tokenizer pool)."""
        try:
            return model.tokenizer.apply_chat_template([m.template_dict() for m in req.messages])
        except Exception as exc:  # template errors (bad roles, missing fields) are the client's
            raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None

    def check_ids(self, model: ServedModel, ids: list[int], param: str) -> list[int]:
        vocab = model.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param=param)
        return list(ids)

    def check_limits(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The router's caps on a request's lists (the engines refuse anything above theirs too)."""
        s = self.settings
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > s.max_stop_strings:
            raise bad_request(f"stop: at most {s.max_stop_strings} stop strings, got {len(stops)}", param="stop")
        if any(len(stop) > s.max_stop_chars for stop in stops):
            raise bad_request(f"stop: stop strings may be at most {s.max_stop_chars} characters", param="stop")
        if len(req.stop_token_ids or []) > s.max_stop_token_ids:
            raise bad_request(f"stop_token_ids: at most {s.max_stop_token_ids} ids, got {len(req.stop_token_ids)}",
                              param="stop_token_ids")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")

    def prepare(self, model: ServedModel, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                max_tokens: int | None, logprobs: int | None, prompt_param: str) -> Prepared:
        limit = self.context_limit(model)
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
            self.check_ids(model, req.stop_token_ids, "stop_token_ids")
        try:
            base = SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None
        per_choice = []
        for i in range(req.n):
            d = base.to_dict()
            d["n"] = 1
            if base.seed is not None:  # seed + i, wrapped into the signed 64-bit range
                d["seed"] = (base.seed + i + _INT64 // 2) % _INT64 - _INT64 // 2
            per_choice.append(d)
        return Prepared(model=model, prompt_ids=prompt_ids, sampling=per_choice, stop=list(base.stop),
                        skip_special_tokens=base.skip_special_tokens, stream=req.stream,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage))

    # -- running

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

    # -- OpenAI formatting

    def completion_logprobs(self, tokenizer: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [tokenizer.token_text(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{tokenizer.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, tokenizer: Tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        tt, tb = tokenizer.token_text, tokenizer.token_bytes
        return [{"token": tt(lp.token_id), "logprob": lp.logprob, "bytes": tb(lp.token_id),
                 "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": tb(t)} for t, v in lp.top]}
                for lp in lps]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _has_text(prompt: Any) -> bool:
    # A list is all ids or holds one prompt (validated as a whole: a mixed list is refused either way).
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int))


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _has_key(router: Router, request: Request) -> bool:
    """True when no API key is configured or the request's bearer token is one of them. Compared in constant
    time with every key (no early exit), so neither a key's bytes nor which key matched shows in the timing."""
    keys = router.settings.accepted_keys
    if not keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched and scheme.lower() == "bearer"


def _check_auth(router: Router, request: Request) -> None:
    if not _has_key(router, request):
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

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request bodies the endpoints parse themselves (`_parse`)."""
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
        if not _has_key(router, request):  # probes without a key learn the status only, not the topology
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
            _check_auth(router, request)
        return Response(render(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_auth(router, request)
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "pdcluster",
                                            "root": m.info.path, "max_model_len": router.context_limit(m)}
                                           for m in router.models.values()]}

    @app.post("/v1/completions", openapi_extra=request_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        _check_auth(router, request)
        req: CompletionRequest = await parse_body(request, CompletionRequest, settings.max_body_bytes)
        model = router.model(req.model)
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        router.check_limits(req)
        if _has_text(req.prompt):
            prompt_ids = await router.off_loop(router.completion_prompt, model, req)
        else:   # token ids: no tokenizer to run, and a hop through the pool costs more than the check
            prompt_ids = router.completion_prompt(model, req)
        prep = router.prepare(model, req, prompt_ids, req.max_tokens, req.logprobs, "prompt")
        return await serve(request, prep, chat=False, want_logprobs=req.logprobs is not None)

    @app.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        _check_auth(router, request)
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
        model = router.model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        router.check_limits(req)
        prompt_ids = await router.off_loop(router.chat_prompt, model, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = router.prepare(model, req, prompt_ids, max_tokens, logprobs, "messages")
        return await serve(request, prep, chat=True, want_logprobs=req.logprobs)

    async def serve(request: Request, prep: Prepared, chat: bool, want_logprobs: bool) -> Response:
        if router.draining:
            router.metrics.requests.labels("unavailable").inc()
            raise APIError(503, f"router {settings.node_id} is draining", retry_after=settings.retry_after)
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
        tok = prep.model.tokenizer
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": {"content": router.chat_logprobs(tok, logprobs[i]), "refusal": None}
                        if want_logprobs else None,
                        "finish_reason": finish[i]} for i in range(len(runs))]
            return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                 "created": created, "model": prep.model.name, "choices": choices,
                                 "usage": usage})
        choices = [{"index": i, "text": texts[i],
                    "logprobs": router.completion_logprobs(tok, logprobs[i], 0) if want_logprobs else None,
                    "finish_reason": finish[i]} for i in range(len(runs))]
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
                             "model": prep.model.name, "choices": choices, "usage": usage})

    async def stream_body(prep: Prepared, runs: list[ChoiceRun], chat: bool, want_logprobs: bool,
                          arrival: float) -> AsyncIterator[bytes]:
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": prep.model.name}
        offsets = [0] * len(runs)
        tok = prep.model.tokenizer
        outcome = "client_disconnected"

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> bytes:
            body = dict(head, choices=choices)
            if prep.include_usage:
                body["usage"] = usage
            return _sse(body)

        def choice(delta: ChoiceDelta) -> dict[str, Any]:
            if chat:
                lp = ({"content": router.chat_logprobs(tok, delta.logprobs), "refusal": None}
                      if want_logprobs and delta.logprobs else None)
                content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
                return {"index": delta.index, "delta": content, "logprobs": lp,
                        "finish_reason": delta.finish_reason}
            lp = router.completion_logprobs(tok, delta.logprobs, offsets[delta.index]) if want_logprobs else None
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
                yield b"data: [DONE]\n\n"
                return
            usage = router.count_tokens(prep, runs, arrival)
            if prep.include_usage:
                yield chunk([], usage)
            yield b"data: [DONE]\n\n"
            outcome = "ok"
        finally:
            router.metrics.requests.labels(outcome).inc()

    return app


class _SSEResponse(StreamingResponse):
    """An SSE response that releases its request even when the body generator never started
    (the client left before the first byte): `cleanup` runs exactly once, however it ends."""

    def __init__(self, body: AsyncIterator[bytes], cleanup: Any) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
