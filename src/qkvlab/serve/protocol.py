"""The OpenAI/vLLM protocol: request schemas, response bodies, and text out of tokens.

A request is validated strictly (pydantic, no coercion: "5" is not an integer, true is not a
number, NaN and inf are refused, unknown fields are refused) and every failure becomes one message
naming the field and what is allowed. OpenAI fields qkvlab does not implement are accepted only at
their neutral value (best_of 1, no logit_bias, no suffix, no tools), so a client that
sends them by default is served and one that relies on them is told. vLLM's extensions that are
implemented: presence and frequency penalties (OpenAI's, in [-2, 2]), top_k, ignore_eos, stop_token_ids, skip_special_tokens, add_special_tokens, and for
chat add_generation_prompt, continue_final_message, chat_template_kwargs; any other is refused
by name as an unknown field.

`TextStream` turns a sequence's tokens into text deltas: it holds back an incomplete UTF-8
character and anything that may still grow into a stop string, and cuts the text at the first stop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qkvlab.base.settings import SEED_MAX

MAX_STOPS = 4  # as OpenAI
MAX_N = 128  # choices per request, as OpenAI
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs and OpenAI's chat
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
LOGPROB_FLOOR = -9999.0  # what vLLM reports for a log-probability of -inf (JSON has no infinity)
NEUTRAL_ONLY = {  # OpenAI fields not implemented: the neutral value a client may send by default
    "best_of": "1 or null",
    "suffix": "null",
    "logit_bias": "null or {}",
    "tools": "null (no tool calling)",
    "tool_choice": '"none" or null',
    "response_format": '{"type": "text"} or null',
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's; accepted at its default only


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Sampled(Strict):
    """What completions and chat share: the model, sampling, stops, streaming, choices."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension: 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)  # the seeds every qkvlab command takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    ignore_eos: bool = False  # vLLM's: do not stop at the end-of-text / end-of-turn tokens
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # vLLM's: more tokens that end a choice
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampled):
    """POST /v1/completions. `prompt`: text (needs the model's tokenizer), token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Literal[1] | None = None
    suffix: None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc., as transformers encodes by default

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a list (a list of ints is one prompt of token ids)."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]  # required, null refused (what a chat template reads)
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """What a chat template reads: role and content as a string (text parts joined by newlines, as vLLM does)."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        out = {"role": self.role, "content": content}
        return {**out, "name": self.name} if self.name is not None else out


class Templated(Strict):
    """What renders messages through the chat template (chat and /tokenize)."""

    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True  # vLLM's: end with the assistant's turn opening
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is left open to continue
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template

    def template_args(self) -> dict[str, Any]:
        extra = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            extra["continue_final_message"] = True
        return {"add_generation_prompt": self.add_generation_prompt and not self.continue_final_message, **extra}


class ChatRequest(Sampled, Templated):
    """POST /v1/chat/completions."""

    max_tokens: int | None = Field(None, ge=1)  # default: the rest of the context, as vLLM
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = False  # vLLM's: the template writes the special tokens itself
    tools: None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Literal["text"]] | None = None


class TokenizeRequest(Strict):
    """POST /tokenize, as vLLM: a prompt, or messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def templated(self) -> Templated:
        return Templated(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(Strict):
    """POST /detokenize, as vLLM."""

    model: str | None = None
    tokens: list[int]


def problem(error: ValidationError, schema: type[BaseModel] = CompletionRequest) -> tuple[str, str | None]:
    """The first validation error as (one line naming the field and what is allowed, the field)."""
    e = error.errors(include_url=False)[0]
    if e["type"] == "json_invalid":
        return f"malformed JSON: {e['msg'].removeprefix('Invalid JSON: ')}", None
    loc = [
        str(p)
        for p in e["loc"]
        if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "bool", "list", "TextPart")))
    ]
    field = loc[0] if loc else None
    got = repr(e.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if e["type"] == "model_type" and not loc:
        return f"the request body must be a JSON object, got {got}", None
    if e["type"] == "missing":
        return f"missing field {'.'.join(loc)!r}: the request needs it", field
    if e["type"] == "extra_forbidden":
        where = ".".join(loc[:-1])
        allowed = schema.model_fields if len(loc) == 1 else {}
        tail = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return f"unknown field {loc[-1]!r}{f' in {where}' if where else ''}{tail}", field
    if field == "prompt":
        return f"prompt must be a string, a list of integer token ids, or a list of either, got {got}", field
    if field == "stop":
        return f"stop must be a string or a list of strings, got {got}", field
    if field == "messages" and loc[-1] == "content":
        where = ".".join(loc)
        return f"{where} must be a string or a list of text parts (the model reads text only), got {got}", field
    if field in NEUTRAL_ONLY and len(loc) == 1:
        return f"{field}: qkvlab serve accepts only {NEUTRAL_ONLY[field]}, got {got}", field
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


def completion_id(kind: str = "cmpl") -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def completion_body(cid: str, model: str, choices: list[dict], usage: dict | None) -> dict:
    """A completion (or, with usage None, one streamed chunk of it)."""
    body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def completion_choice(index: int, text: str, finish: str | None, ids: list[int], logprobs: dict | None) -> dict:
    """token_ids: the generated ids, qkvlab's addition."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}


def chat_body(cid: str, model: str, choices: list[dict], usage: dict | None, chunk: bool = False) -> dict:
    kind = "chat.completion.chunk" if chunk else "chat.completion"
    body = {"id": cid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_choice(index: int, text: str, finish: str | None, ids: list[int], logprobs: dict | None) -> dict:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}


def chat_delta(index: int, delta: dict, finish: str | None, ids: list[int], logprobs: dict | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def completion_logprobs(entries: Sequence[tuple], text_of: Callable[[int], str], offset: int = 0) -> dict:
    """entries: (token, logprob or None, top or None) -> OpenAI's legacy logprobs object, offsets
    counted in characters of each token's text from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        piece = text_of(token)
        out["tokens"].append(piece)
        out["token_logprobs"].append(None if lp is None else _lp(lp))
        out["top_logprobs"].append(None if top is None else {text_of(t): _lp(v) for t, v in top})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def chat_logprobs(entries: Sequence[tuple], text_of: Callable[[int], str]) -> dict:
    """entries: (token, logprob, top) -> OpenAI's chat logprobs object."""

    def one(token: int, lp: float) -> dict:
        piece = text_of(token)
        return {"token": piece, "logprob": _lp(lp), "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, v) for a, v in top or ()]} for t, lp, top in entries]}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
