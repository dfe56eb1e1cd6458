"""Continuous batching over the slot pool: sequences join and leave the running batch at every step.

One step (`Engine.step`), on the engine's own thread, never on the HTTP event loop:
1. retire: finished and cancelled sequences leave, their rows are freed (a client that
   disconnected is cancelled by the app, so its row frees here, at the next step);
2. admit: waiting requests take free rows, first come first served; their prompts are prefilled
   together (left padded, as `qkvlab.generate` does), copied into their rows, and their first
   token is sampled;
3. decode: one token for every running sequence in one forward pass over rows [0, n).

Each sequence computes exactly what `qkvlab.generate` computes for it alone: the same prefill, the
same cached keys and values, each row attending to its own tokens only; so greedy tokens match.
Admission is by rows, and rows by cache bytes: the pool holds --cache-memory / (bytes per token x
context) sequences, so a scheme that caches less serves more at once. When every row is taken,
requests wait in the queue; they never fail for lack of room.

Tokens leave through each request's `emit(Event)`, called on the engine thread (the app forwards
them to its event loop). Sampling is per request: its temperature, top-k, top-p and seed.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkvlab.errors import UserError
from qkvlab.generate import Sampling, check_prompts, decode_step, left_pad, max_steps, new_cache, next_token, prefill
from qkvlab.serve.slots import SlotPool

PREFILL_TOKENS = 4096  # padded prompt tokens prefilled in one step (at least one whole prompt): bounds a step


class Draining(Exception):
    """The server is shutting down: no new requests (HTTP 503)."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling(temperature=0.0)
    seed: int | None = None


@dataclass(frozen=True)
class Event:
    """A new token, or the end of a sequence with its reason: stop (end of text or a stop string),
    length (max_tokens or the context), cancelled, shutdown (the drain timed out), error."""

    token: int | None = None
    finish: str | None = None


class Sequence:
    """One request inside the engine: where it is and what it may still produce."""

    def __init__(self, sid: int, request: Request, emit: Callable[[Event], None], steps: int, generator):
        self.id, self.request, self.emit = sid, request, emit
        self.steps = steps  # tokens it may produce (max_tokens, fewer where the context ends)
        self.generator = generator
        self.produced = 0
        self.position = len(request.prompt)  # of the token fed next; also the columns its row has filled
        self.pending: int | None = None  # the last sampled token, fed at the next decode step
        self.cancel_reason: str | None = None
        self.done = False

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.emit(Event(finish=reason))


class Engine:
    def __init__(self, model, rows: int, *, eot_id: int | None = None, vocab_limit: int | None = None):
        self.model, self.eot_id, self.vocab_limit = model, eot_id, vocab_limit
        self.device = next(model.parameters()).device
        self.pool = SlotPool(model, rows)
        self.running: list[Sequence] = []  # running[i] occupies row i
        self.waiting: deque[Sequence] = deque()
        self.cv = threading.Condition()  # guards waiting, draining, counters; wakes the loop
        self.draining = self._stopping = False
        self.active = self.peak_active = self.tokens = self.finished = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request: Request, emit: Callable[[Event], None]) -> Sequence:
        """Queue a request (UserError for a bad one, Draining while shutting down)."""
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise UserError(f"max_tokens={request.max_tokens!r} must be an integer >= 1")
        check_prompts(self.model, [request.prompt])
        request.sampling.validate()
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.seed) if request.seed is not None else generator.seed()
        steps = max_steps(self.model, [request.prompt], request.max_tokens)
        with self.cv:
            if self.draining:
                raise Draining("the server is shutting down")
            seq = Sequence(next(self._ids), request, emit, steps, generator)
            self.waiting.append(seq)
            self.cv.notify_all()
        return seq

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence: a queued one leaves now, a running one frees its row at the next step."""
        with self.cv:
            seq.cancel_reason = seq.cancel_reason or reason
            if seq in self.waiting:
                self.waiting.remove(seq)
                seq.finish(reason)
            self.cv.notify_all()

    def stats(self) -> dict[str, int]:
        with self.cv:
            return {
                "capacity_sequences": self.pool.rows,
                "active": self.active,
                "queued": len(self.waiting),
                "peak_active": self.peak_active,
                "tokens_generated": self.tokens,
                "requests_finished": self.finished,
            }

    def idle(self) -> bool:
        return self.active == 0 and not self.waiting

    def begin_drain(self) -> None:
        with self.cv:
            self.draining = True

    def wait_idle(self, timeout: float | None) -> bool:
        with self.cv:
            return self.cv.wait_for(self.idle, timeout)

    def abort_all(self, reason: str = "shutdown") -> None:
        with self.cv:
            for seq in [*self.waiting, *self.running]:
                self.cancel(seq, reason)

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="qkvlab-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self._stopping or self.waiting or self.running)
                if self._stopping:
                    return
            self.step()

    # ---- the step, on the engine thread --------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Retire, admit, decode once. A failure ends the sequences it touched, never the engine."""
        try:
            self._retire()
            admitted = self._admit()
            if admitted:
                try:
                    logits = self._prefill(admitted)
                finally:
                    self.running += admitted  # rows were taken in order: running[i] is row i
                self._sample(logits, admitted)
                self._retire()
            if self.running:
                self._decode()
        except Exception:  # noqa: BLE001 (a bug or an out-of-memory must not stop the server)
            traceback.print_exc(file=sys.stderr)
            for seq in self.running:
                seq.finish("error")
            self.running.clear()  # their rows are free: the next occupants overwrite them
        finally:
            self._retire()
            with self.cv:
                self.active = len(self.running)
                self.peak_active = max(self.peak_active, self.active)
                self.cv.notify_all()

    def _retire(self) -> None:
        """Drop finished and cancelled sequences; the last row moves into each freed one."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.cancel_reason is not None:
                seq.finish(seq.cancel_reason)
            if not seq.done:
                i += 1
                continue
            last = self.running.pop()
            if last is not seq:
                self.pool.move(len(self.running), i, last.position)
                self.running[i] = last
            with self.cv:
                self.finished += 1

    def _admit(self) -> list[Sequence]:
        """Waiting sequences for the free rows, up to PREFILL_TOKENS padded prompt tokens."""
        free = self.pool.rows - len(self.running)
        out: list[Sequence] = []
        with self.cv:
            while self.waiting and len(out) < free:
                longest = max(len(s.request.prompt) for s in [*out, self.waiting[0]])
                if out and longest * (len(out) + 1) > PREFILL_TOKENS:
                    break
                out.append(self.waiting.popleft())
            self.active = len(self.running) + len(out)  # busy from leaving the queue on
            self.peak_active = max(self.peak_active, self.active)
        return out

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prompts left padded into a scratch cache, then each row's real tokens into its pool row
        -> logits (B, V) after each prompt."""
        prompts = [s.request.prompt for s in seqs]
        batch = left_pad(prompts, device=self.device)
        T = batch.idx.shape[1]
        scratch = new_cache(self.model, len(prompts), T)
        logits = prefill(self.model, scratch, batch)
        for j, p in enumerate(prompts):
            self.pool.load(len(self.running) + j, scratch, j, T - len(p), len(p))
        return logits

    def _decode(self) -> None:
        tokens = torch.tensor([s.pending for s in self.running], device=self.device)
        positions = torch.tensor([s.position for s in self.running], device=self.device)
        width = max(s.position for s in self.running) + 1
        logits = decode_step(self.model, self.pool.step(positions, width), tokens, positions)
        for s in self.running:
            s.position += 1
        self._sample(logits, self.running)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits (B, V) of seqs -> each one's next token, emitted (end of text is not)."""
        tokens = next_token(logits, Sampling(temperature=0.0), vocab_limit=self.vocab_limit).tolist()
        for j, s in enumerate(seqs):
            if not s.request.sampling.greedy:
                try:
                    tokens[j] = int(next_token(logits[j : j + 1], s.request.sampling, s.generator, self.vocab_limit)[0])
                except RuntimeError:  # e.g. a temperature so small the probabilities overflow: this one only
                    s.finish("error")
        emitted = 0
        for s, t in zip(seqs, tokens):
            if s.done:
                continue
            s.produced += 1
            if self.eot_id is not None and t == self.eot_id:
                s.finish("stop")
                continue
            s.pending = t
            s.emit(Event(token=t))
            emitted += 1
            if s.produced >= s.steps:
                s.finish("length")
        with self.cv:
            self.tokens += emitted
