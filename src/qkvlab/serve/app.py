"""The HTTP side: FastAPI routes over the async engine, OpenAI's and vLLM's shapes, every error a JSON body.

- POST /v1/completions: a prompt (text or token ids) or a list of them, n choices each -> a
  completion, or with "stream": true server-sent events, one chunk per token and choice;
- POST /v1/chat/completions: messages rendered through the model's own chat template (the
  tokenizer's, by transformers' apply_chat_template), streamed or whole;
- GET /v1/models, /v1/models/{id}: the one model, its context and chat template;
- POST /tokenize, /detokenize: as vLLM spells them;
- GET /health: capacity, load and the decoding choices (503 while draining); GET /metrics:
  Prometheus, vLLM's names.

Bad input never reaches the engine: the body is read up to MAX_BODY_BYTES (beyond it the rest is
read and dropped, up to DISCARD_BYTES, so the client gets its 413 rather than a reset connection),
parsed and validated strictly (400 naming the field), its text bounded and tokenized on a worker
thread (prompts.py), the prompt checked against the vocabulary and the context (400). A client that
disconnects is cancelled, so its blocks free at the engine's next step.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from qkvlab.serve import protocol as proto
from qkvlab.serve.async_engine import AsyncEngine
from qkvlab.serve.job import Job
from qkvlab.serve.prompts import chat_prompts, check_ids, check_model, completion_prompts, parse, tokenize_body
from qkvlab.serve.served import ApiError, ServedModel

MAX_BODY_BYTES = 4 * 2**20  # a prompt of a whole 128k-token context as text or ids fits
DISCARD_BYTES = 256 * 2**20  # read and dropped past the limit before answering 413; beyond, the connection closes


def create_app(engine: AsyncEngine, served: ServedModel, *, max_body: int = MAX_BODY_BYTES, metrics=None) -> FastAPI:
    app = FastAPI(title="qkvlab serve", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    add_info_routes(app, engine, served, metrics)
    add_generation_routes(app, engine, served, max_body)
    app.state.engine = engine
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(proto.error_body(e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # 404 / 405 for unknown routes, in the same shape
        return JSONResponse(proto.error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):  # a bug: the client still gets JSON (the log has the traceback)
        return JSONResponse(proto.error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


def add_info_routes(app: FastAPI, engine: AsyncEngine, served: ServedModel, metrics) -> None:
    @app.get("/health")
    async def health():
        body = {"status": "draining" if engine.draining else "ok", **served.health(), **engine.stats()}
        return JSONResponse(body, status_code=503 if engine.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off on this server (prometheus_client is not installed)")
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, served)
        return served.card()


def add_generation_routes(app: FastAPI, engine: AsyncEngine, served: ServedModel, max_body: int) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, max_body)
        req, prompts = await run_in_threadpool(completion_prompts, body, served, engine.vocab_size)
        return await respond(request, Job(engine, served, req, prompts, chat=False))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request, max_body)
        req, prompts = await run_in_threadpool(chat_prompts, body, served, engine.vocab_size)
        return await respond(request, Job(engine, served, req, prompts, chat=True))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, max_body)
        return await run_in_threadpool(tokenize_body, body, served)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(await read_body(request, max_body), proto.DetokenizeRequest)
        check_model(req.model, served)
        check_ids(req.tokens, engine.vocab_size, "tokens")
        return {"prompt": served.decode(req.tokens, skip_special_tokens=False)}


async def respond(request: Request, job: Job):
    if job.req.stream:
        return StreamingResponse(job.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        return JSONResponse(await job.whole())
    finally:
        watcher.cancel()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past `limit` bytes, answered once the rest is read and dropped (up to
    DISCARD_BYTES) so the client, still sending, reads the answer instead of a reset."""
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DISCARD_BYTES:
            break
        if size <= limit and (declared is None or declared <= limit):
            chunks.append(chunk)
    if size > limit or (declared is not None and declared > limit):
        told = f" of {declared:,} bytes" if declared is not None else ""
        raise ApiError(413, f"request body{told} exceeds the limit of {limit:,} bytes")
    return b"".join(chunks)


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to go away (the body is already read), then cancel its sequences."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
