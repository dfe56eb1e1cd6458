"""A request body -> the validated request and its prompts' token ids, on a worker thread (never the
event loop), or one ApiError naming what is wrong.

Tokenizing a prompt is bounded before it starts: a text longer than the context's tokens can spell
(the tokenizer's longest token, in characters, times the context) is refused at once, so no megabyte
prompt is tokenized only to be refused (/tokenize excepted: vLLM checks no length there; the body
limit bounds it). The lengths as vLLM checks them: a prompt longer than
--max-model-len, or a prompt and max_tokens together longer, are refused (400) naming the numbers.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from qkvlab.base.errors import UserError
from qkvlab.serve import protocol as proto
from qkvlab.serve.served import ApiError, ServedModel


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


def check_ids(ids: list[int], vocab: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=where)


def tokenizer_of(served: ServedModel, what: str):
    if served.tokenizer is None:
        raise ApiError(400, f"this model has no tokenizer: {what}", param="prompt")
    return served.tokenizer


def encode(served: ServedModel, text: str, add_special_tokens: bool, bounded: bool = True) -> list[int]:
    """A prompt's ids; `bounded`: refused at once when longer than the context can hold (/tokenize is not
    bounded: vLLM tokenizes any text there, which the body limit bounds)."""
    tok = tokenizer_of(served, "send the prompt as a list of token ids")
    if not text:
        raise ApiError(400, "empty prompt: give at least one character to start from", param="prompt")
    most = served.context * tok.max_chars_per_token  # more characters than that: more tokens than the context
    if bounded and len(text) > most:
        raise ApiError(
            400,
            f"prompt of {len(text):,} characters is longer than the model's context of {served.context:,} tokens "
            f"can hold (tokens of at most {tok.max_chars_per_token} characters)",
            param="prompt",
        )
    return tok.encode(text, add_special_tokens=add_special_tokens)


def render(served: ServedModel, req: proto.Templated) -> str:
    tok = tokenizer_of(served, "chat needs one (and its chat template); use /v1/completions with token ids")
    try:
        return tok.render_chat([m.as_dict() for m in req.messages], **req.template_args())
    except UserError as e:
        raise ApiError(400, str(e), param="messages") from None


def check_lengths(served: ServedModel, prompts: list[list[int]], max_tokens: int | None) -> None:
    """vLLM's checks: each prompt within --max-model-len, and with max_tokens beside it."""
    for ids in prompts:
        if not ids:
            raise ApiError(400, "empty prompt: give at least one token to start from", param="prompt")
        if len(ids) > served.context:
            raise ApiError(
                400,
                f"prompt of {len(ids):,} tokens is longer than the model's context of {served.context:,}",
                param="prompt",
            )
        if max_tokens is not None and len(ids) + max_tokens > served.context:
            raise ApiError(
                400,
                f"max_tokens={max_tokens:,} is too large: this model's maximum context length is {served.context:,} "
                f"tokens and the request has {len(ids):,} input tokens ({max_tokens:,} > {served.context:,} - "
                f"{len(ids):,})",
                param="max_tokens",
            )


def completion_prompts(body: bytes, served: ServedModel, vocab: int) -> tuple[proto.CompletionRequest, list]:
    """The request and its prompts' ids."""
    req = parse(body, proto.CompletionRequest)
    check_model(req.model, served)
    prompts = [p if isinstance(p, list) else encode(served, p, req.add_special_tokens) for p in req.prompts()]
    for p in prompts:
        check_ids(p, vocab, "prompt")
    check_lengths(served, prompts, req.max_tokens)
    return req, prompts


def chat_prompts(body: bytes, served: ServedModel, vocab: int) -> tuple[proto.ChatRequest, list]:
    """The request and its rendered, tokenized prompt."""
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
        ids = encode(served, req.prompt, special, bounded=False)
    else:
        ids = encode(served, render(served, req.templated()), bool(req.add_special_tokens), bounded=False)
    strs = [served.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.context, "tokens": ids, "token_strs": strs}
