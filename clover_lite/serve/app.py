"""The HTTP application: OpenAI's chat and completion endpoints, models, health, and joint decisions.

Requests are checked (serve/requests.py) and their prompts tokenised before they queue, so a bad one is
refused at once with a 4xx; the engine work runs in the scheduler's one worker thread (serve/scheduler.py).
What a text request means for the engine (its settings, the worker's loop) is one class per kind of engine,
picked at start: serve/block_text.py or serve/diffusion_gemma_text.py. Prompts and replies are never logged
unless `log_prompts` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from clover_lite.errors import GenerationError, NonFiniteError
from clover_lite.runtime.decide import question_list
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine
from clover_lite.runtime.engine import Engine
from clover_lite.runtime.text_stream import TextStreamer
from clover_lite.serve.block_text import BlockText
from clover_lite.serve.diffusion_gemma_text import DiffusionGemmaText
from clover_lite.serve.requests import ApiError, TextRequest, bad, chat_request, completion_request, decide_request
from clover_lite.serve.responses import ChunkWriter, Reply, full_response, new_id
from clover_lite.serve.scheduler import DONE, ERROR, ITEM, Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("clover_lite.serve")
POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class ServeSettings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_queue: int = 16
    log_prompts: bool = False


class ClientGone(Exception):
    pass


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def from_engine_error(e: BaseException) -> ApiError:
    """What a failure inside the worker means for the client."""
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), type="server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, NonFiniteError):
        return ApiError(500, f"the model's logits went non-finite: {e}", type="server_error", code="non_finite")
    if isinstance(e, GenerationError):
        return bad(str(e))
    said = str(e).encode("utf-8", "backslashreplace").decode("utf-8")  # a response body must be UTF-8
    return ApiError(500, f"internal error ({type(e).__name__}: {said}); the server goes on serving",
                    type="server_error", code="internal_error")


async def read_json(request: Request, limit: int):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes, over this server's limit of {limit}; "
                            "send less (or start the server with a larger --max-body-mb)", code="body_too_large")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise ApiError(413, f"the request body is over this server's limit of {limit} bytes; send less "
                                "(or start the server with a larger --max-body-mb)", code="body_too_large")
    try:
        return json.loads(data.decode("utf-8"))  # JSON over HTTP is UTF-8 (RFC 8259)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON in the request body: {e.msg} at line {e.lineno} column {e.colno}",
                  code="malformed_json") from None
    except RecursionError:
        raise bad("the JSON in the request body is nested too deeply to read; send a flatter body",
                  code="malformed_json") from None


class Server:
    """The endpoints over one engine."""

    def __init__(self, engine: Engine | DiffusionGemmaEngine, settings: ServeSettings):
        self.engine = engine
        self.settings = settings
        self.scheduler = Scheduler(settings.max_queue)
        # The model's text requests: chosen once, here (a block denoiser or DiffusionGemma).
        text = DiffusionGemmaText if isinstance(engine, DiffusionGemmaEngine) else BlockText
        self.texts = text(engine, self.scheduler)

    # ---- plumbing -----------------------------------------------------------------------------------
    def authorised(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key "
                                "the server was started with", type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def submit(self, work: Callable[[Job], object], label: str) -> Job:
        job = Job(work, asyncio.get_running_loop(), label)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry after {e.retry_after} s", type="server_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown as e:
            raise from_engine_error(e) from None
        return job

    async def next_item(self, job: Job, request: Request) -> tuple:
        """The job's next item; a client that disconnects while waiting cancels the job (ClientGone)."""
        task = asyncio.ensure_future(job.items.get())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        except (ClientGone, asyncio.CancelledError):  # the client left, or the server stops: free the engine
            task.cancel()
            job.cancel()
            raise

    # ---- text generation ----------------------------------------------------------------------------
    async def text(self, request: Request, kind: str) -> Response:
        t0 = time.monotonic()
        self.authorised(request)
        body = await read_json(request, self.settings.max_body_bytes)
        texts = self.texts
        req = chat_request(body, texts.extension) if kind == "chat" else \
            completion_request(body, texts.vocab_size, texts.extension)
        prepared = await texts.prepare(req)
        job = self.submit(texts.work(prepared, req.stream), kind)
        rid, model = new_id(kind), self.settings.model_id
        try:
            first = await self.next_item(job, request)
        except ClientGone:
            return Response(status_code=499)
        if first[0] == ERROR:
            raise from_engine_error(first[1])
        if not req.stream:
            reply = first[1]
            self.log_done(kind, 200, reply, job, t0, req.prompt)
            return JSONResponse(full_response(kind, rid, model, reply, job.queue_seconds))
        return StreamingResponse(self.sse(kind, rid, model, req, prepared.stop, job, first, t0),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def sse(self, kind: str, rid: str, model: str, req: TextRequest, stop: tuple[str, ...], job: Job,
                  first: tuple, t0: float) -> AsyncIterator[str]:
        out = ChunkWriter(kind, rid, model)
        streamer = TextStreamer(stop)
        finished = False
        try:
            if kind == "chat":
                yield out.chunk(role=True)
            item = first
            while True:
                what, value = item
                if what == ITEM:
                    piece = streamer.feed(value)
                    if piece:
                        yield out.chunk(piece)
                elif what == DONE:
                    rest = streamer.finish(value.text)
                    if rest:
                        yield out.chunk(rest)
                    finished = True
                    self.log_done(kind, 200, value, job, t0, req.prompt)
                    yield out.finish(value, job.queue_seconds, req.include_usage)
                    return
                else:
                    finished = True
                    err = from_engine_error(value)
                    log.warning("%s stream ended by an error: %s", kind, err.message)
                    yield out.error(err.body())
                    return
                try:
                    item = await job.items.get()
                except asyncio.CancelledError:  # the drain time is over: say so, then end the stream
                    if not self.scheduler.closing:
                        raise
                    job.cancel()
                    item = (ERROR, ShuttingDown("the server stopped before this request finished"))
        finally:
            if not finished:  # the client went away mid-stream (or the server is stopping): free the engine
                job.cancel()

    # ---- joint decisions ----------------------------------------------------------------------------
    async def decide(self, request: Request) -> Response:
        t0 = time.monotonic()
        self.authorised(request)
        if self.texts.decide_refusal:  # whatever the body holds
            raise bad(self.texts.decide_refusal, code="unsupported_model")
        req = decide_request(await read_json(request, self.settings.max_body_bytes))
        try:
            pairs = question_list(req.questions)
            self.engine.canvas_config(**req.overrides)
        except GenerationError as e:
            raise bad(str(e)) from None
        engine = self.engine
        job = self.submit(lambda job: engine.decide(req.context, pairs, req.mode, **req.overrides), "decide")
        try:
            what, value = await self.next_item(job, request)
        except ClientGone:
            return Response(status_code=499)
        if what == ERROR:
            raise from_engine_error(value)
        d = value
        log.info("decide 200 questions=%d forwards=%d queue=%.2fs total=%.2fs", len(pairs), d.forwards,
                 job.queue_seconds, time.monotonic() - t0)
        return JSONResponse({
            "id": new_id("decide"), "object": "clover.decision", "model": self.settings.model_id,
            "answers": d.answers, "confidence": d.confidence, "probabilities": d.probabilities, "order": d.order,
            "mode": d.mode,
            "forwards": d.forwards, "commit_forwards": d.commit_forwards, "seconds": round(d.seconds, 4),
            "queue_seconds": round(job.queue_seconds, 4),
        })

    # ---- models and health --------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.settings.model_id, "object": "model", "created": 0, "owned_by": "clover-lite",
                "clover": self.texts.card()}

    async def models(self, request: Request) -> Response:
        self.authorised(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        self.authorised(request)
        name = request.path_params["name"]
        if name != self.settings.model_id:
            raise ApiError(404, f"no model '{name}' here; this server serves '{self.settings.model_id}'",
                           param="model", code="model_not_found")
        return JSONResponse(self.model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.settings.model_id, **self.scheduler.status()})

    def log_done(self, kind: str, status: int, reply: Reply, job: Job, t0: float, prompt) -> None:
        log.info("%s %d prompt=%d completion=%d forwards=%d finish=%s queue=%.2fs total=%.2fs", kind, status,
                 reply.prompt_tokens, reply.completion_tokens, reply.statistics["forwards"], reply.finish_reason,
                 job.queue_seconds, time.monotonic() - t0)
        if self.settings.log_prompts:
            log.info("%s prompt=%r reply=%r", kind, prompt, reply.text)


class QuietShutdown:
    """Once the drain time is over, uvicorn cancels the responses still open; each has already told its client
    (a 503, or an error event ending its stream), so the cancellation ends it quietly instead of as a traceback
    in the log."""

    def __init__(self, app, scheduler: Scheduler):
        self.app, self.scheduler = app, scheduler

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.scheduler.closing:
                raise


def create_app(engine: Engine | DiffusionGemmaEngine, settings: ServeSettings) -> Starlette:
    """The ASGI app serving `engine`; its lifespan stops the worker thread on shutdown."""
    server = Server(engine, settings)

    def endpoint(handler: Callable[[Request], Awaitable[Response]]):
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                if e.status >= 500:
                    log.warning("%s %s -> %d %s", request.method, request.url.path, e.status, e.message)
                return error_response(e)
            except asyncio.CancelledError:  # uvicorn cancels what is still open once the drain time is over
                if not server.scheduler.closing:
                    raise
                return error_response(from_engine_error(ShuttingDown("the server stopped before this request "
                                                                     "finished")))
            except Exception as e:  # a bug: one JSON 500 and the traceback in the log, and the server goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return error_response(from_engine_error(e))
        return run

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; "
                                       "endpoints: /v1/chat/completions, /v1/completions, /v1/models, "
                                       "/v1/clover/decide, /health", code="not_found"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(server.scheduler.close, 5.0)

    routes = [
        Route("/v1/chat/completions", endpoint(lambda r: server.text(r, "chat")), methods=["POST"]),
        Route("/v1/completions", endpoint(lambda r: server.text(r, "completion")), methods=["POST"]),
        Route("/v1/clover/decide", endpoint(server.decide), methods=["POST"]),
        Route("/v1/models", endpoint(server.models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint(server.model), methods=["GET"]),
        Route("/health", endpoint(server.health), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan,
                    middleware=[Middleware(QuietShutdown, scheduler=server.scheduler)])
    app.state.server = server
    return app
