"""The HTTP side: FastAPI routes over an Engine, OpenAI's shapes, every error a JSON body.

- POST /v1/completions: one prompt (text or token ids) -> a completion, or with "stream": true
  server-sent events, one chunk per token (text held back only while a stop string may be forming);
- GET /v1/models: the one model served;
- GET /health: capacity and load (503 while draining).

Bad input never reaches the engine: the body is read up to MAX_BODY_BYTES (413 beyond it), parsed
and validated strictly (400 naming the field), the prompt checked against the vocabulary and the
context (400). A client that disconnects is cancelled, so its row frees at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from qkvlab.errors import UserError
from qkvlab.generate import Sampling
from qkvlab.serve import protocol as proto
from qkvlab.serve.engine import Draining, Engine, Event
from qkvlab.serve.engine import Request as EngineRequest

MAX_BODY_BYTES = 4 * 2**20  # a prompt of a whole 128k-token context as text or ids fits


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass(frozen=True)
class ServedModel:
    """What the app tells clients about the model (and needs to turn text into tokens)."""

    name: str
    scheme: str
    context: int
    cache_bytes_per_token: int
    cache_bytes: int
    tokenizer: object | None = None  # encode/decode/eot_id, or None: prompts are token ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else proto.ids_text(ids)


def create_app(engine: Engine, served: ServedModel, *, max_body: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="qkvlab serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(proto.error_body(e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # 404 / 405 for unknown routes, in the same shape
        return JSONResponse(proto.error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):  # a bug: the client still gets JSON (the log has the traceback)
        return JSONResponse(proto.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        body = {
            "status": "draining" if engine.draining else "ok",
            "model": served.name,
            "scheme": served.scheme,
            "context": served.context,
            "cache_bytes_per_token": served.cache_bytes_per_token,
            "cache_bytes": served.cache_bytes,
            **engine.stats(),
        }
        return JSONResponse(body, status_code=503 if engine.draining else 200)

    @app.get("/v1/models")
    async def models():
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "qkvlab"}
        return {"object": "list", "data": [{**card, "max_model_len": served.context, "scheme": served.scheme}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await read_body(request, max_body))
        if req.model is not None and req.model != served.name:
            raise ApiError(
                404, f"model {req.model!r} is not served here; this server serves {served.name!r}", param="model"
            )
        prompt = prompt_ids(req, served)
        events: asyncio.Queue[Event] = asyncio.Queue()
        seq = submit(engine, req, prompt, events)
        run = Completion(engine, seq, events, served, req, len(prompt))
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(cancel_on_disconnect(request, engine, seq))
        try:
            return JSONResponse(await run.whole())
        finally:
            watcher.cancel()

    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (before reading it when Content-Length says so)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {int(length):,} bytes exceeds the limit of {limit:,} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse(body: bytes) -> proto.CompletionRequest:
    try:
        req = proto.CompletionRequest.model_validate_json(body)
    except ValidationError as e:
        message, field = proto.problem(e)
        raise ApiError(400, message, param=field) from None
    stop_problem = proto.check_stops(req.stops())
    if stop_problem:
        raise ApiError(400, stop_problem, param="stop")
    return req


def prompt_ids(req: proto.CompletionRequest, served: ServedModel) -> list[int]:
    if isinstance(req.prompt, str):
        if served.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        if not req.prompt:
            raise ApiError(400, "empty prompt: give at least one character to start from", param="prompt")
        ids = served.tokenizer.encode(req.prompt)
    else:
        ids = req.prompt
    if len(ids) > served.context:
        raise ApiError(
            400,
            f"prompt of {len(ids):,} tokens is longer than the model's context of {served.context:,}",
            param="prompt",
        )
    if req.max_tokens > served.context:
        raise ApiError(
            400, f"max_tokens={req.max_tokens:,} exceeds the model's context of {served.context:,}", param="max_tokens"
        )
    return ids


def submit(engine: Engine, req: proto.CompletionRequest, prompt: list[int], events: asyncio.Queue):
    """Queue the request; the engine thread hands its events to this event loop's queue."""
    loop = asyncio.get_running_loop()

    def emit(event: Event) -> None:  # on the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    sampling = Sampling(req.temperature, req.top_k, req.top_p)
    try:
        return engine.submit(EngineRequest(tuple(prompt), req.max_tokens, sampling, req.seed), emit)
    except Draining as e:
        raise ApiError(503, f"{e}; retry on another server", kind="unavailable") from None
    except UserError as e:
        raise ApiError(400, str(e), param="prompt") from None


async def cancel_on_disconnect(request: Request, engine: Engine, seq) -> None:
    """Wait for the client to go away (the body is already read), then cancel its sequence."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(seq)


class Completion:
    """One request's events turned into a response, whole or streamed."""

    def __init__(self, engine, seq, events: asyncio.Queue, served: ServedModel, req, prompt_tokens: int):
        self.engine, self.seq, self.events, self.served, self.req = engine, seq, events, served, req
        self.text = proto.TextStream(served.decode, req.stops())
        self.id, self.prompt_tokens, self.ids = proto.completion_id(), prompt_tokens, []

    async def next(self) -> tuple[str, str | None]:
        """The next text delta and, once the sequence has ended, its finish reason."""
        event = await self.events.get()
        if event.finish is not None:
            return self.text.flush(), event.finish
        self.ids.append(event.token)
        delta = self.text.push(event.token)
        if self.text.stopped:
            self.engine.cancel(self.seq, "stop")
            return delta, "stop"
        return delta, None

    def _fail(self, finish: str) -> ApiError | None:
        if finish == "shutdown":
            return ApiError(503, "the server shut down before this request finished", kind="unavailable")
        if finish == "error":
            return ApiError(500, "the engine failed on this request (see the server log)", kind="server_error")
        return None

    async def whole(self) -> dict:
        finish = None
        while finish is None:
            _, finish = await self.next()
        if (err := self._fail(finish)) is not None:
            raise err
        usage = proto.usage_body(self.prompt_tokens, len(self.ids))
        return proto.completion_body(self.id, self.served.name, self.text.text, finish, self.ids, usage)

    async def sse(self) -> AsyncIterator[str]:
        finish = None
        try:
            while finish is None:
                delta, finish = await self.next()
                if (err := self._fail(finish)) is not None:
                    yield _event(proto.error_body(err.message, err.kind))
                    break
                ids = self.ids[-1:] if finish is None else []
                yield _event(proto.completion_body(self.id, self.served.name, delta, finish, ids, None))
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                usage = proto.usage_body(self.prompt_tokens, len(self.ids))
                yield _event({**proto.completion_body(self.id, self.served.name, "", None, [], usage), "choices": []})
            yield "data: [DONE]\n\n"
        finally:
            if finish is None:  # the client went away (or the response was cancelled): free the row
                self.engine.cancel(self.seq)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
