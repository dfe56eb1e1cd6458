"""One HTTP request's generation: its prompts x n choices submitted through the async engine, their
events turned into a response, whole or streamed as server-sent events.

Usage as vLLM counts it: prompt_tokens once per prompt (not per choice), completion_tokens every
token each choice produced, the token that stopped it (end of text / turn, a stop_token_ids entry)
included, as vLLM's output token_ids include it; an echoed prompt is not counted again.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from qkvlab.base.errors import UserError
from qkvlab.decode.sampling import Sampling
from qkvlab.serve import protocol as proto
from qkvlab.serve.async_engine import AsyncEngine
from qkvlab.serve.prompts import check_ids
from qkvlab.serve.request import Draining, Request
from qkvlab.serve.served import ApiError, ServedModel


class Choice:
    """One choice's tokens, text and log-probabilities as they arrive."""

    def __init__(self, index: int, prompt: list[int], job: Job):
        self.index, self.prompt = index, prompt
        decode = lambda ids: job.served.decode(ids, job.req.skip_special_tokens)  # noqa: E731
        self.text = proto.TextStream(decode, job.req.stops())
        self.ids: list[int] = []
        self.stop_token = 0  # 1 when a stop token ended it (counted in usage, as vLLM does)
        self.entries: list[tuple] = []  # (token, logprob, top) per emitted token, with logprobs
        self.prompt_entries: list[tuple] | None = None
        self.finish: str | None = None


class Job:
    """Choice i*n + j is prompt i's j-th (OpenAI's order)."""

    def __init__(self, engine: AsyncEngine, served: ServedModel, req, prompts: list[list[int]], *, chat: bool):
        self.served, self.req, self.prompts, self.chat = served, req, prompts, chat
        self.id = proto.completion_id("chatcmpl" if chat else "cmpl")
        n = req.n
        self.choices = [Choice(i * n + j, p, self) for i, p in enumerate(prompts) for j in range(n)]
        self.logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
        self.echo = not chat and req.echo
        try:
            self.stream = engine.generate([self.engine_request(engine, p) for p in prompts])
        except Draining as e:
            raise ApiError(503, f"{e}; retry on another server", kind="unavailable") from None
        except UserError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def engine_request(self, engine: AsyncEngine, prompt: list[int]) -> Request:
        req = self.req
        stops = None
        if req.ignore_eos or req.stop_token_ids:
            check_ids(req.stop_token_ids or [], engine.vocab_size, "stop_token_ids")
            base = frozenset() if req.ignore_eos else engine.stop_ids
            stops = base | frozenset(req.stop_token_ids or ())
        max_tokens = req.max_tokens
        if self.chat:
            max_tokens = req.max_completion_tokens or req.max_tokens or self.served.context  # the engine caps it
        return Request(
            tuple(prompt),
            max_tokens,
            Sampling(req.temperature, max(req.top_k, 0), req.top_p),
            req.seed,
            n=req.n,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            stop_ids=stops,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
        )

    def cancel(self, reason: str = "cancelled") -> None:
        self.stream.cancel(reason)

    @property
    def running(self) -> int:
        return sum(c.finish is None for c in self.choices)

    async def next(self) -> tuple[Choice, str, str | None, bool]:
        """The next event's choice, text delta, finish reason once that choice has ended, and
        whether the event brought a token (a stop string ends a choice on its token)."""
        while True:
            index, event = await self.stream.next()
            c = self.choices[index]
            if c.finish is not None:  # e.g. the engine's end after a stop string already ended it here
                continue
            if event.finish is not None:
                c.finish = event.finish
                c.stop_token = int(event.stop_token is not None)
                return c, c.text.flush(), event.finish, False
            c.ids.append(event.token)
            if event.prompt is not None:
                c.prompt_entries = [(t, lp, top) for t, (lp, top) in zip(c.prompt, event.prompt)]
            if self.logprobs is not None:
                c.entries.append((event.token, event.logprob, event.top))
            delta = c.text.push(event.token)
            if c.text.stopped:
                self.stream.cancel("stop", index)
                c.finish = "stop"
            return c, delta, c.finish, True

    @staticmethod
    def failure(finish: str | None) -> ApiError | None:
        if finish == "shutdown":
            return ApiError(503, "the server shut down before this request finished", kind="unavailable")
        if finish == "error":
            return ApiError(500, "the engine failed on this request (see the server log)", kind="server_error")
        return None

    def usage(self) -> dict:
        produced = sum(len(c.ids) + c.stop_token for c in self.choices)
        return proto.usage_body(sum(len(p) for p in self.prompts), produced)

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
            if (err := self.failure(finish)) is not None:
                self.cancel()
                raise err
        choices = []
        for c in self.choices:
            lp = self.logprobs_body(c, [*(c.prompt_entries or []), *c.entries])
            if self.chat:
                choices.append(proto.chat_choice(c.index, c.text.text, c.finish, c.ids, lp))
            else:
                choices.append(proto.completion_choice(c.index, self.echo_text(c) + c.text.text, c.finish, c.ids, lp))
        build = proto.chat_body if self.chat else proto.completion_body
        return build(self.id, self.served.name, choices, self.usage())

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        if self.chat:
            return event_line(proto.chat_body(self.id, self.served.name, choices, usage, chunk=True))
        return event_line(proto.completion_body(self.id, self.served.name, choices, usage))

    def _piece(self, c: Choice, delta: str, finish: str | None, token: bool, first: bool) -> str:
        """One streamed chunk: a choice's token (or its end)."""
        ids = c.ids[-1:] if token else []
        entries = c.entries[-1:] if token and self.logprobs is not None else []
        if self.chat:
            lp = self.logprobs_body(c, entries) if entries else None
            content = {"content": delta} if delta or finish is None else {}
            return self._chunk([proto.chat_delta(c.index, content, finish, ids, lp)])
        if first:  # echo: the prompt comes first, with its logprobs
            delta = self.echo_text(c) + delta
            entries = [*(c.prompt_entries or []), *entries]
        lp = self.logprobs_body(c, entries) if entries else None
        return self._chunk([proto.completion_choice(c.index, delta, finish, ids, lp)])

    async def sse(self) -> AsyncIterator[str]:
        started: set[int] = set()
        failed = False
        try:
            if self.chat:  # as OpenAI: each choice opens with the assistant's role
                for c in self.choices:
                    yield self._chunk([proto.chat_delta(c.index, {"role": "assistant", "content": ""}, None, [], None)])
            while self.running:
                c, delta, finish, token = await self.next()
                if (err := self.failure(finish)) is not None:
                    yield event_line(proto.error_body(err.message, err.kind))
                    failed = True
                    break
                yield self._piece(c, delta, finish, token, c.index not in started)
                started.add(c.index)
            if self.req.include_usage and not failed:
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            if self.running:  # the client went away (or the response was cancelled): free the blocks
                self.cancel()


def event_line(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
