"""The router's HTTP API: OpenAI /v1/completions and /v1/chat/completions, /v1/models, /health, /metrics.

`RouterAPI` serves a `router.Router` (what a request needs) and reads the drain state of its
`membership.RouterMembership`; each endpoint validates (`validation.py`), starts one stream per choice, then
answers whole or as SSE (`responses.py`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Coroutine, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from pdcluster.control.metrics import CONTENT_TYPE_LATEST, render
from pdcluster.router import chat_output, responses, responses_api, utility
from pdcluster.router.auth import check_auth, has_key
from pdcluster.router.cluster import NodeSource
from pdcluster.router.decode_client import InvalidRequest, NoCapacity, StreamFailed
from pdcluster.router.errors import APIError, error_body, install_error_handlers
from pdcluster.router.generation import ChoiceRun, TokenLogprob, merge
from pdcluster.router.membership import RouterMembership
from pdcluster.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    openapi_components,
    parse_body,
    request_body,
)
from pdcluster.router.router import Router, build_router
from pdcluster.router.settings import RouterSettings
from pdcluster.router.validation import (
    Prepared,
    chat_prompt,
    check_request,
    completion_prompt,
    echo_text,
    has_text,
    prepare,
)

T = TypeVar("T")


class _App(FastAPI):
    """FastAPI whose schema also holds the request bodies the endpoints parse themselves (`parse_body`),
    `model` limited to the served names."""

    def __init__(self, served: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.served = served

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components(self.served))
            self.openapi_schema = schema
        return self.openapi_schema


class RouterAPI:
    """The endpoints of `router`, as `app`. `membership` None (tests, a router on a static node list with no
    record or drain): the router never drains."""

    def __init__(self, router: Router, membership: RouterMembership | None = None) -> None:
        self.router = router
        self.membership = membership
        self.settings = router.settings
        app = self.app = _App(list(router.models), title="pdcluster router", lifespan=self.lifespan)
        app.state.router = router
        install_error_handlers(app)
        app.add_api_route("/health", self.health, methods=["GET"], responses={503: {
            "description": "not ready (a served model has no decode node) or draining: the error shape, with "
                           "the same fields as a 200 beside it"}})
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"],
                          openapi_extra=request_body("CompletionRequest"))
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"],
                          openapi_extra=request_body("ChatCompletionRequest"))
        app.add_api_route("/v1/responses", self.responses, methods=["POST"],
                          openapi_extra=request_body("ResponsesRequest"))
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], openapi_extra=request_body("TokenizeRequest"))
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"],
                          openapi_extra=request_body("DetokenizeRequest"))
        app.add_api_route("/version", utility.version, methods=["GET"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"],
                          openapi_extra=request_body("LoadLoRAAdapterRequest"))
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"],
                          openapi_extra=request_body("UnloadLoRAAdapterRequest"))

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.router.start()
        if self.membership is not None:
            await self.membership.start()
        try:
            yield
        finally:
            if self.membership is not None:
                await self.membership.stop()
            await self.router.stop()

    @property
    def draining(self) -> bool:
        """Admin drain (membership.py): new requests get 503, open streams finish."""
        return self.membership is not None and self.membership.draining

    async def health(self, request: Request) -> dict[str, Any]:
        """200 {"status": "ok", ...} once every served model has a decode node taking work; until then
        ("no_decode_nodes") and while draining, 503 in the error shape with the same fields beside "error"."""
        cluster = self.router.cluster
        models = {name: sorted(n.id for n in cluster.candidates("decode", model=name)) for name in self.router.models}
        missing = [name for name, ids in models.items() if not ids]
        status = "draining" if self.draining else "no_decode_nodes" if missing else "ok"
        body: dict[str, Any] = {"status": status}
        keyed = has_key(self.settings, request)
        if keyed:  # probes without a key learn the status only, not the topology
            body.update(router=self.settings.node_id, decode_nodes=sorted(n.id for n in cluster.candidates("decode")),
                        prefill_nodes=sorted(n.id for n in cluster.candidates("prefill")), models=models,
                        in_flight=self.router.in_flight)
        if status == "ok":
            return body
        message = (f"router {self.settings.node_id} is draining" if self.draining
                   else f"no decode node serves {', '.join(map(repr, missing))} yet" if keyed
                   else "not every served model has a decode node yet")
        raise APIError(503, message, code=status, retry_after=self.settings.retry_after, extra=body)

    async def metrics(self, request: Request) -> Response:
        if self.settings.metrics_require_key:
            check_auth(self.settings, request)
        return Response(render(self.router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> dict[str, Any]:
        """The served models that some decode node serves now (a request for another still waits for one), then
        the LoRA adapters of those, with their `parent` (vLLM's listing)."""
        check_auth(self.settings, request)
        router, cluster = self.router, self.router.cluster
        data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "pdcluster", "root": m.info.path,
                 "parent": None, "max_model_len": router.context_limit(m)}
                for m in router.models.values() if cluster.candidates("decode", model=m.name)]
        listed = {d["id"] for d in data}
        for a in router.loras.listed():
            if a.parent in listed:
                data.append({"id": a.name, "object": "model", "created": 0, "owned_by": "pdcluster",
                             "root": a.path or a.name, "parent": a.parent,
                             "max_model_len": router.context_limit(router.models[a.parent])})
        return {"object": "list", "data": data}

    async def load_lora_adapter(self, request: Request) -> Response:
        """Place a LoRA adapter on every node of its base model that runs with enable_lora (vLLM's endpoint)."""
        check_auth(self.settings, request)
        body: LoadLoRAAdapterRequest = await parse_body(request, LoadLoRAAdapterRequest, self.settings.max_body_bytes)
        router = self.router
        parent = body.base_model or (next(iter(router.models)) if len(router.models) == 1 else None)
        if parent is None:
            raise APIError(400, "base_model: name the served model the adapter adapts (this router serves "
                                f"{', '.join(map(repr, router.models))})", param="base_model")
        router.model(parent)   # 404 if not served
        assert router.decode is not None, "router not started"
        await router.loras.load(router.decode.dealers, router.decode.replies, body.lora_name, body.lora_path, parent)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        check_auth(self.settings, request)
        body: UnloadLoRAAdapterRequest = await parse_body(request, UnloadLoRAAdapterRequest,
                                                          self.settings.max_body_bytes)
        router = self.router
        assert router.decode is not None, "router not started"
        await router.loras.unload(router.decode.dealers, router.decode.replies, body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    async def completions(self, request: Request) -> Response:
        check_auth(self.settings, request)
        req: CompletionRequest = await parse_body(request, CompletionRequest, self.settings.max_body_bytes)
        router = self.router
        model = router.model(req.model)
        check_request(self.settings, req)
        if has_text(req.prompt):
            prompt_ids = await router.off_loop(completion_prompt, model, req)
        else:   # token ids: no tokenizer to run, and a hop through the pool costs more than the check
            prompt_ids = completion_prompt(model, req)
        echo = await router.off_loop(echo_text, model, req, prompt_ids) if req.echo else None   # may decode ids
        prep = prepare(self.settings, model, req, prompt_ids, router.context_limit(model), req.max_tokens,
                       req.logprobs, "prompt", echo)
        return await self.serve(request, prep, chat=False, want_logprobs=req.logprobs is not None)

    async def chat_completions(self, request: Request) -> Response:
        check_auth(self.settings, request)
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, self.settings.max_body_bytes)
        router = self.router
        model = router.model(req.model)
        check_request(self.settings, req)
        prompt_ids = await router.off_loop(chat_prompt, model, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = prepare(self.settings, model, req, prompt_ids, router.context_limit(model), max_tokens, logprobs,
                       "messages")
        chat_output.attach(self.settings, prep, req)
        return await self.serve(request, prep, chat=True, want_logprobs=req.logprobs)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served by the chat path (responses_api.py)."""
        check_auth(self.settings, request)
        body: responses_api.ResponsesRequest = await parse_body(request, responses_api.ResponsesRequest,
                                                                self.settings.max_body_bytes)
        req = responses_api.to_chat(body)
        router = self.router
        model = router.model(req.model)
        check_request(self.settings, req)
        prompt_ids = await router.off_loop(chat_prompt, model, req)
        prep = prepare(self.settings, model, req, prompt_ids, router.context_limit(model),
                       req.max_completion_tokens, None, "input")
        chat_output.attach(self.settings, prep, req)
        writer = responses_api.ResponseWriter(body, model.name,
                                              chat_output.ChatOutput(prep.chat) if prep.chat else None)
        return await self.serve(request, prep, chat=True, want_logprobs=False, writer=writer)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        check_auth(self.settings, request)
        body: TokenizeRequest = await parse_body(request, TokenizeRequest, self.settings.max_body_bytes)
        model = self.router.model(body.model or next(iter(self.router.models)))
        return await self.router.off_loop(utility.tokenize, model, body, self.router.context_limit(model))

    async def detokenize(self, request: Request) -> dict[str, Any]:
        check_auth(self.settings, request)
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest, self.settings.max_body_bytes)
        model = self.router.model(body.model or next(iter(self.router.models)))
        return await self.router.off_loop(utility.detokenize, model, body)

    def admit(self) -> None:
        """Count a request in flight, or refuse it: 503 while draining, 429 at `max_in_flight`."""
        if self.draining:
            self.router.metrics.requests.labels("unavailable").inc()
            raise APIError(503, f"router {self.settings.node_id} is draining", retry_after=self.settings.retry_after)
        self.router.admit()

    async def serve(self, request: Request, prep: Prepared, chat: bool, want_logprobs: bool,
                    writer: responses_api.ResponseWriter | None = None) -> Response:
        """`writer`: answer in the Responses API's shape, not chat's."""
        router = self.router
        self.admit()
        arrival = time.monotonic()
        handed_off = False
        try:
            streams = await _unless_disconnected(request, router.start_streams(prep))
            runs = router.runs(prep, streams, arrival)
            if prep.stream:
                handed_off = True  # the response owns the in-flight count and the streams from here

                def cleanup() -> None:
                    for run in runs:
                        run.stream.abort("client")
                    router.release()

                body = (self.response_events(prep, runs, arrival, writer) if writer is not None
                        else self.stream_body(prep, runs, chat, want_logprobs, arrival))
                return responses.SSEResponse(body, cleanup)
            return await self.whole_body(request, prep, runs, chat, want_logprobs, arrival, writer)
        except ClientGone:   # it left waiting for a decode node, for the first tokens or for the whole body
            router.metrics.requests.labels("client_disconnected").inc()
            return Response(status_code=499)
        finally:
            if not handed_off:
                router.release()

    async def whole_body(self, request: Request, prep: Prepared, runs: list[ChoiceRun], chat: bool,
                         want_logprobs: bool, arrival: float,
                         writer: responses_api.ResponseWriter | None = None) -> Response:
        texts = [""] * len(runs)
        logprobs: list[list[TokenLogprob]] = [[] for _ in runs]
        prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in runs]
        finish: list[str | None] = [None] * len(runs)

        async def collect() -> None:
            async for delta in merge(runs):
                texts[delta.index] += delta.text
                logprobs[delta.index].extend(delta.logprobs)
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[delta.index] = delta.prompt_logprobs
                if delta.finish_reason:
                    finish[delta.index] = delta.finish_reason

        metrics = self.router.metrics
        try:
            await _unless_disconnected(request, collect())
        except (NoCapacity, StreamFailed) as exc:
            metrics.requests.labels("failed").inc()
            raise APIError(503, f"generation failed: {exc}", retry_after=self.settings.retry_after) from None
        except InvalidRequest as exc:
            metrics.requests.labels("invalid").inc()
            raise APIError(400, str(exc), code="invalid_request") from None
        usage = self.router.count_tokens(prep, runs, arrival)
        metrics.requests.labels("ok").inc()
        if writer is not None:
            return JSONResponse(writer.body(texts[0], finish[0], usage))
        return JSONResponse(responses.full_body(prep, chat, want_logprobs, texts, logprobs, finish, usage,
                                                prompt_logprobs))

    async def stream_body(self, prep: Prepared, runs: list[ChoiceRun], chat: bool, want_logprobs: bool,
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
            except InvalidRequest as exc:   # headers are sent: the 400 goes in the stream
                outcome = "invalid"
                yield responses.sse(error_body(400, str(exc), code="invalid_request"))
                yield responses.DONE
                return
            usage = self.router.count_tokens(prep, runs, arrival)
            if prep.include_usage:
                yield out.usage(usage)
            yield responses.DONE
            outcome = "ok"
        finally:
            self.router.metrics.requests.labels(outcome).inc()


    async def response_events(self, prep: Prepared, runs: list[ChoiceRun], arrival: float,
                              writer: responses_api.ResponseWriter) -> AsyncIterator[bytes]:
        outcome = "client_disconnected"
        try:
            try:
                async for chunk in writer.events(merge(runs), lambda: self.router.count_tokens(prep, runs, arrival)):
                    yield chunk
            except (NoCapacity, StreamFailed, InvalidRequest) as exc:
                outcome = "failed" if not isinstance(exc, InvalidRequest) else "invalid"
                yield writer.failed(f"generation failed: {exc}")
                return
            outcome = "ok"
        finally:
            self.router.metrics.requests.labels(outcome).inc()


class ClientGone(Exception):
    """The client disconnected before the work it waited for was done."""


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientGone, with `work` cancelled, when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: RouterSettings, source: NodeSource, registry: CollectorRegistry | None = None) -> FastAPI:
    """The app of a router on `source` with no membership (no etcd record, no drain) and no cluster secret:
    what tests and embedding code serve. `server.run_router` builds the production one."""
    return RouterAPI(build_router(settings, source, registry)).app
