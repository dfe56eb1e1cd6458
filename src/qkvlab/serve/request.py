"""What the engine is asked (Request), what it answers (Event), and one choice on its way (Sequence).

A request of n choices becomes n sequences, as vLLM's parallel sampling does: each computes on its own,
and those after the first find the prompt's full blocks in the prefix cache (kv_cache_manager.py),
so the prompt is computed once but for its last partial block. Seeded sampling gives choice i the
seed + i, so choice 0 is what n = 1 gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkvlab.decode.sampling import Sampling
from qkvlab.serve.kv_cache_manager import block_key

TopK = tuple[tuple[int, float], ...]  # (token id, log-probability), most probable first


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling(temperature=0.0)
    seed: int | None = None
    n: int = 1  # choices
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    stop_ids: frozenset[int] | None = None  # None: the engine's (end of text / turn); empty: never stop on a token
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it appeared in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time it appeared in the output


@dataclass(frozen=True)
class Event:
    """A new token, or the end of a sequence with its reason: stop (end of text or a stop string),
    length (max_tokens or the context), cancelled, shutdown (the drain timed out), error.
    `index`: which of the request's choices; logprob/top: with Request.logprobs; prompt: with
    Request.prompt_logprobs, on a choice's first event, one (logprob, top) per prompt token."""

    token: int | None = None
    finish: str | None = None
    index: int = 0
    logprob: float | None = None
    top: TopK | None = None
    prompt: tuple[tuple[float | None, TopK | None], ...] | None = None
    stop_token: int | None = None  # with finish "stop": the token that ended it (not emitted, but counted)


class Draining(Exception):
    """The server is shutting down: no new requests (HTTP 503)."""


class Sequence:
    """One choice of a request inside the engine: its tokens, what of them the cache holds, its blocks."""

    def __init__(
        self, sid: int, request: Request, index: int, emit: Callable[[Event], None], steps: int, stops, device
    ):
        self.id, self.request, self.index, self.emit = sid, request, index, emit
        self.steps = steps  # tokens it may produce (max_tokens, fewer where the context ends)
        self.stops = stops  # token ids that end it (not emitted)
        self.generator = None if request.sampling.greedy else torch.Generator(device=device)
        if self.generator is not None:
            seed = request.seed
            self.generator.manual_seed(seed + index) if seed is not None else self.generator.seed()
        self.tokens: list[int] = list(request.prompt)  # prompt, then every token emitted
        self.computed = 0  # tokens whose keys and values the cache holds
        self.table: list[int] = []  # its blocks, in order
        self.keys: list[bytes] = []  # prefix-cache keys of its full blocks so far
        self.produced = 0  # tokens sampled, a stop token included
        self.counts: dict[int, int] = {}  # output token -> times produced (penalties)
        self.prompt_lp: list = []  # (logprob, top) per prompt token, with prompt_logprobs
        self.cancel_reason: str | None = None
        self.done = False
        self.metrics = None  # metrics.Metrics, set by the engine
        self.arrived = time.perf_counter()
        self.first: float | None = None  # when its first token was emitted
        self.last: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def emitted(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt log-probabilities need every prompt token's logits: such a sequence computes them all."""
        return self.request.prompt_logprobs is None

    def block_keys(self, block_size: int) -> list[bytes]:
        """The keys of its full blocks (extended as its tokens fill blocks)."""
        while (len(self.keys) + 1) * block_size <= len(self.tokens):
            i = len(self.keys)
            self.keys.append(
                block_key(self.keys[-1] if self.keys else None, self.tokens[i * block_size : (i + 1) * block_size])
            )
        return self.keys

    def finish(self, reason: str, stop_token: int | None = None) -> None:
        if not self.done:
            self.done = True
            if self.metrics is not None:
                self.metrics.finished(self, reason, time.perf_counter())
            self.emit(Event(finish=reason, index=self.index, stop_token=stop_token))
