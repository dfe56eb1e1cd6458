"""What the HTTP side knows of the served model (its name, context, cache, tokenizer, the decoding
choices it was built with), and the one error a route raises."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qkvlab.serve import protocol as proto


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
    decisions: dict = field(default_factory=dict)  # decoding.RunnerDecoding.report(): dtype, its probe, layouts
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

    def health(self) -> dict:
        return {
            "model": self.name,
            "scheme": self.scheme,
            "context": self.context,
            "cache_bytes_per_token": self.cache_bytes_per_token,
            "cache_bytes": self.cache_bytes,
            **self.decisions,
        }
