"""The HTTP side: FastAPI routes over an Engine, OpenAI's and vLLM's shapes, every error a JSON body.

- POST /v1/completions: a prompt (text or token ids) or a list of them, n choices each -> a
  completion, or with "stream": true server-sent events, one chunk per token and choice;
- POST /v1/chat/completions: messages rendered through the model's own chat template (the
  tokenizer's, by transformers' apply_chat_template), streamed or whole;
- GET /v1/models, /v1/models/{id}: the one model, its context and chat template;
- POST /tokenize, /detokenize: as vLLM spells them;
- GET /health: capacity and load (503 while draining); GET /metrics: Prometheus, vLLM's names.

Bad input never reaches the engine: the body is read up to MAX_BODY_BYTES (413 beyond it), parsed
and validated strictly (400 naming the field), the prompt checked against the vocabulary and the
context (400). Parsing and tokenizing run on a worker thread, so a megabyte prompt does not stall
the event loop (/health, other streams). A client that disconnects is cancelled, so its rows free
at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from qkvlab.base.errors import UserError
from qkvlab.decode.generate import Sampling, layout_decisions
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
    context: int  # the longest sequence served (--max-model-len)
    cache_bytes_per_token: int
    cache_bytes: int
    tokenizer: object | None = None  # a serve.tokens.ServeTokenizer, or None: prompts are token ids
    dtype: str | None = None  # the weights' and cache's dtype
    dtype_probe: dict | None = None  # the figures `--dtype auto` was decided from (dtype_probe.Decision.record)
    created: int = field(default_factory=lambda: int(time.time()))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return proto.ids_text(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_text(token) if self.tokenizer is not None else proto.ids_text([token])

    def card(self) -> dict:
        template = getattr(self.tokenizer, "chat_template", None)
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "qkvlab",
            "root": self.name,
            "parent": None,
            "max_model_len": self.context,
            "scheme": self.scheme,
            "chat_template": template,
        }


def create_app(engine: Engine, served: ServedModel, *, max_body: int = MAX_BODY_BYTES, metrics=None) -> FastAPI:
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
            "dtype": served.dtype,
            "dtype_probe": served.dtype_probe,
            "decode_layouts": layout_decisions,  # timed on this machine once the first batch held one
            **engine.stats(),
        }
        return JSONResponse(body, status_code=503 if engine.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off on this server (prometheus_client is not installed)")
        from qkvlab.serve.metrics import CONTENT_TYPE

        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, served)
        return served.card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, max_body)
        req, prompts = await run_in_threadpool(completion_prompts, body, served)
        return await respond(request, Job(engine, served, req, prompts, chat=False))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request, max_body)
        req, prompts = await run_in_threadpool(chat_prompts, body, served)
        return await respond(request, Job(engine, served, req, prompts, chat=True))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, max_body)
        return await run_in_threadpool(tokenize_body, body, served)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(await read_body(request, max_body), proto.DetokenizeRequest)
        check_model(req.model, served)
        check_ids(req.tokens, engine, "tokens")
        return {"prompt": served.decode(req.tokens, skip_special_tokens=False)}

    async def respond(request: Request, job: Job):
        if job.req.stream:
            return StreamingResponse(job.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(cancel_on_disconnect(request, job))
        try:
            return JSONResponse(await job.whole())
        finally:
            watcher.cancel()

    app.state.engine = engine
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


def parse(body: bytes, schema: type[BaseModel]):
    try:
        req = schema.model_validate_json(body)
    except ValidationError as e:
        message, where = proto.problem(e, schema)
        raise ApiError(400, message, param=where) from None
    if isinstance(req, proto.Sampled):
        stop_problem = proto.check_stops(req.stops())
        if stop_problem:
            raise ApiError(400, stop_problem, param="stop")
    return req


def check_model(name: str | None, served: ServedModel) -> None:
    if name is not None and name != served.name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {served.name!r}", param="model")


def check_ids(ids: list[int], engine: Engine, where: str) -> None:
    vocab = engine.model.cfg.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=where)


def tokenizer_of(served: ServedModel, what: str):
    if served.tokenizer is None:
        raise ApiError(400, f"this model has no tokenizer: {what}", param="prompt")
    return served.tokenizer


def encode(served: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    tok = tokenizer_of(served, "send the prompt as a list of token ids")
    if not text:
        raise ApiError(400, "empty prompt: give at least one character to start from", param="prompt")
    return tok.encode(text, add_special_tokens=add_special_tokens)


def render(served: ServedModel, req: proto.Templated) -> str:
    tok = tokenizer_of(served, "chat needs one (and its chat template); use /v1/completions with token ids")
    try:
        return tok.render_chat([m.as_dict() for m in req.messages], **req.template_args())
    except UserError as e:
        raise ApiError(400, str(e), param="messages") from None


def check_lengths(served: ServedModel, prompts: list[list[int]], max_tokens: int | None) -> None:
    for ids in prompts:
        if not ids:
            raise ApiError(400, "empty prompt: give at least one token to start from", param="prompt")
        if len(ids) > served.context:
            raise ApiError(
                400,
                f"prompt of {len(ids):,} tokens is longer than the model's context of {served.context:,}",
                param="prompt",
            )
    if max_tokens is not None and max_tokens > served.context:
        raise ApiError(
            400, f"max_tokens={max_tokens:,} exceeds the model's context of {served.context:,}", param="max_tokens"
        )


def completion_prompts(body: bytes, served: ServedModel) -> tuple[proto.CompletionRequest, list[list[int]]]:
    """On a worker thread: the request and its prompts' ids."""
    req = parse(body, proto.CompletionRequest)
    check_model(req.model, served)
    prompts = [p if isinstance(p, list) else encode(served, p, req.add_special_tokens) for p in req.prompts()]
    check_lengths(served, prompts, req.max_tokens)
    return req, prompts


def chat_prompts(body: bytes, served: ServedModel) -> tuple[proto.ChatRequest, list[list[int]]]:
    """On a worker thread: the request and its rendered, tokenized prompt."""
    req = parse(body, proto.ChatRequest)
    check_model(req.model, served)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ApiError(400, "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = encode(served, render(served, req), req.add_special_tokens)
    check_lengths(served, [prompt], req.max_completion_tokens or req.max_tokens)
    return req, [prompt]


def tokenize_body(body: bytes, served: ServedModel) -> dict:
    req = parse(body, proto.TokenizeRequest)
    check_model(req.model, served)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = encode(served, req.prompt, special)
    else:
        ids = encode(served, render(served, req.templated()), bool(req.add_special_tokens))
    strs = [served.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.context, "tokens": ids, "token_strs": strs}


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to go away (the body is already read), then cancel its sequences."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class Choice:
    """One choice's tokens, text and log-probabilities as they arrive."""

    def __init__(self, index: int, prompt: list[int], job: Job):
        self.index, self.prompt = index, prompt
        decode = lambda ids: job.served.decode(ids, job.req.skip_special_tokens)  # noqa: E731
        self.text = proto.TextStream(decode, job.req.stops())
        self.ids: list[int] = []
        self.entries: list[tuple] = []  # (token, logprob, top) per emitted token, with logprobs
        self.prompt_entries: list[tuple] | None = None
        self.finish: str | None = None
        self.seq = None


class Job:
    """One request: its prompts x n choices submitted to the engine, their events turned into a
    response, whole or streamed. Choice i*n + j is prompt i's j-th (OpenAI's order)."""

    def __init__(self, engine: Engine, served: ServedModel, req, prompts: list[list[int]], *, chat: bool):
        self.engine, self.served, self.req, self.prompts, self.chat = engine, served, req, prompts, chat
        self.id = proto.completion_id("chatcmpl" if chat else "cmpl")
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        n = req.n
        self.choices = [Choice(i * n + j, p, self) for i, p in enumerate(prompts) for j in range(n)]
        if chat:
            self.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            self.logprobs = req.logprobs
        self.echo = not chat and req.echo
        self.submit()

    def engine_request(self, prompt: list[int]) -> EngineRequest:
        req = self.req
        stops = None
        if req.ignore_eos or req.stop_token_ids:
            check_ids(req.stop_token_ids or [], self.engine, "stop_token_ids")
            base = frozenset() if req.ignore_eos else self.engine.stop_ids
            stops = base | frozenset(req.stop_token_ids or ())
        max_tokens = req.max_tokens
        if self.chat:
            max_tokens = req.max_completion_tokens or req.max_tokens or self.served.context  # the engine caps it
        return EngineRequest(
            tuple(prompt),
            max_tokens,
            Sampling(req.temperature, max(req.top_k, 0), req.top_p),
            req.seed,
            n=req.n,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            stop_ids=stops,
        )

    def submit(self) -> None:
        """Queue every prompt; the engine thread hands its events to this event loop's queue."""
        loop = asyncio.get_running_loop()

        def emitter(base: int):
            def emit(event: Event) -> None:  # on the engine thread
                try:
                    loop.call_soon_threadsafe(self.events.put_nowait, (base + event.index, event))
                except RuntimeError:  # the event loop has closed: nobody is listening any more
                    pass

            return emit

        n = self.req.n
        try:
            for i, prompt in enumerate(self.prompts):
                seqs = self.engine.submit_all(self.engine_request(prompt), emitter(i * n))
                for j, seq in enumerate(seqs):
                    self.choices[i * n + j].seq = seq
        except (Draining, UserError) as e:
            self.cancel()
            if isinstance(e, Draining):
                raise ApiError(503, f"{e}; retry on another server", kind="unavailable") from None
            raise ApiError(400, str(e), param="prompt") from None

    def cancel(self, reason: str = "cancelled") -> None:
        for c in self.choices:
            if c.seq is not None and c.finish is None:
                self.engine.cancel(c.seq, reason)

    @property
    def running(self) -> int:
        return sum(c.finish is None for c in self.choices)

    async def next(self) -> tuple[Choice, str, str | None, bool]:
        """The next event's choice, text delta, finish reason once that choice has ended, and
        whether the event brought a token (a stop string ends a choice on its token)."""
        while True:
            index, event = await self.events.get()
            c = self.choices[index]
            if c.finish is not None:  # e.g. the engine's end after a stop string already ended it here
                continue
            if event.finish is not None:
                c.finish = event.finish
                return c, c.text.flush(), event.finish, False
            c.ids.append(event.token)
            if event.prompt is not None:
                c.prompt_entries = [(t, lp, top) for t, (lp, top) in zip(c.prompt, event.prompt)]
            if self.logprobs is not None:
                c.entries.append((event.token, event.logprob, event.top))
            delta = c.text.push(event.token)
            if c.text.stopped:
                self.engine.cancel(c.seq, "stop")
                c.finish = "stop"
            return c, delta, c.finish, True

    def _fail(self, finish: str | None) -> ApiError | None:
        if finish == "shutdown":
            return ApiError(503, "the server shut down before this request finished", kind="unavailable")
        if finish == "error":
            return ApiError(500, "the engine failed on this request (see the server log)", kind="server_error")
        return None

    def usage(self) -> dict:
        return proto.usage_body(sum(len(p) for p in self.prompts), sum(len(c.ids) for c in self.choices))

    def echo_text(self, c: Choice) -> str:
        return self.served.decode(c.prompt, self.req.skip_special_tokens) if self.echo else ""

    def logprobs_body(self, c: Choice, entries: list[tuple], offset: int = 0) -> dict | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return proto.chat_logprobs(entries, self.served.token_text)
        return proto.completion_logprobs(entries, self.served.token_text, offset)

    async def whole(self) -> dict:
        while self.running:
            _, _, finish, _ = await self.next()
            if (err := self._fail(finish)) is not None:
                self.cancel()
                raise err
        choices = []
        for c in self.choices:
            entries = [*(c.prompt_entries or []), *c.entries]
            lp = self.logprobs_body(c, entries)
            if self.chat:
                choices.append(proto.chat_choice(c.index, c.text.text, c.finish, c.ids, lp))
            else:
                choices.append(proto.completion_choice(c.index, self.echo_text(c) + c.text.text, c.finish, c.ids, lp))
        build = proto.chat_body if self.chat else proto.completion_body
        return build(self.id, self.served.name, choices, self.usage())

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        if self.chat:
            return _event(proto.chat_body(self.id, self.served.name, choices, usage, chunk=True))
        return _event(proto.completion_body(self.id, self.served.name, choices, usage))

    async def sse(self) -> AsyncIterator[str]:
        started: set[int] = set()
        failed = False
        try:
            if self.chat:  # as OpenAI: each choice opens with the assistant's role
                for c in self.choices:
                    yield self._chunk([proto.chat_delta(c.index, {"role": "assistant", "content": ""}, None, [], None)])
            while self.running:
                c, delta, finish, token = await self.next()
                if (err := self._fail(finish)) is not None:
                    yield _event(proto.error_body(err.message, err.kind))
                    failed = True
                    break
                ids = c.ids[-1:] if token else []
                entries = c.entries[-1:] if token and self.logprobs is not None else []
                if self.chat:
                    lp = self.logprobs_body(c, entries) if entries else None
                    content = {"content": delta} if delta or finish is None else {}
                    yield self._chunk([proto.chat_delta(c.index, content, finish, ids, lp)])
                else:
                    if c.index not in started:  # echo: the prompt comes first, with its logprobs
                        delta = self.echo_text(c) + delta
                        entries = [*(c.prompt_entries or []), *entries]
                    lp = self.logprobs_body(c, entries) if entries else None
                    yield self._chunk([proto.completion_choice(c.index, delta, finish, ids, lp)])
                started.add(c.index)
            if self.req.include_usage and not failed:
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            if self.running:  # the client went away (or the response was cancelled): free the rows
                self.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
