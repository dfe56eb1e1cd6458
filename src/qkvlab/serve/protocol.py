"""The OpenAI completions protocol: the request schema, the response bodies, and text out of tokens.

A request is validated strictly (pydantic, no coercion: "5" is not an integer, true is not a
number, NaN and inf are refused, unknown fields are refused) and every failure becomes one message
naming the field and what is allowed. OpenAI fields qkvlab does not implement are accepted only at
their neutral value (n=1, echo=false, logprobs=null, penalties 0, best_of 1), so a client that sends
them by default is served and one that relies on them is told.

`TextStream` turns a sequence's tokens into text deltas: it holds back an incomplete UTF-8
character and anything that may still grow into a stop string, and cuts the text at the first stop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qkvlab.settings import SEED_MAX

MAX_STOPS = 4  # as OpenAI


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. `prompt`: text (needs the model's tokenizer) or a list of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str | list[int]
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's (vLLM's extension): 0 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)  # the seeds every qkvlab command takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = Field(None, max_length=0)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def problem(error: ValidationError) -> tuple[str, str | None]:
    """The first validation error as (one line naming the field and what is allowed, the field)."""
    e = error.errors(include_url=False)[0]
    if e["type"] == "json_invalid":
        return f"malformed JSON: {e['msg'].removeprefix('Invalid JSON: ')}", None
    loc = [str(p) for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "bool")))]
    field = loc[0] if loc else None
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if e["type"] == "model_type" and not loc:
        return f"the request body must be a JSON object, got {got}", None
    if e["type"] == "extra_forbidden":
        return f"unknown field {field!r}; allowed: {', '.join(CompletionRequest.model_fields)}", field
    if field == "prompt":
        return f"prompt must be a string or a list of integer token ids, got {got}", field
    if field == "stop":
        return f"stop must be a string or a list of strings, got {got}", field
    return f"{'.'.join(loc)}: {e['msg'][0].lower()}{e['msg'][1:]}, got {got}", field


def check_stops(stops: Sequence[str]) -> str | None:
    if len(stops) > MAX_STOPS:
        return f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}"
    if any(not s for s in stops):
        return "stop: stop strings must not be empty"
    return None


class TextStream:
    """Tokens in, text deltas out, cut at the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode, self.stops = decode, list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # a stop may still be forming
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._delta(final=False)

    def flush(self) -> str:
        """What is left once the sequence has ended."""
        return self._delta(final=True)

    @property
    def text(self) -> str:
        return self._cut(self.decode(self.ids))

    def _cut(self, text: str) -> str:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)]
        return text

    def _delta(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._cut(self.decode(self.ids))
        end = len(text)
        if not (final or self.stopped):
            if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
                return ""
            end = max(self.sent, end - self.hold)
        delta, self.sent = text[self.sent : end], max(self.sent, end)
        return delta


def ids_text(ids: list[int]) -> str:
    """Text of a model without a tokenizer: its token ids, each followed by a space."""
    return "".join(f"{t} " for t in ids)


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion_body(cid: str, model: str, text: str, finish: str | None, ids: list[int], usage: dict | None) -> dict:
    """A completion (or, with usage None, one streamed chunk of it). token_ids: qkvlab's addition."""
    body = {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish, "token_ids": ids}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
