"""Continuous batching over the paged KV cache: sequences join and leave the running batch at every step.

One step (`Engine.step`), on the engine's own thread, never on the HTTP event loop:
1. retire: finished and cancelled sequences leave and give their blocks back (a client that
   disconnected is cancelled by the app, so its blocks free here, at the next step);
2. admit: waiting sequences, first come first served, while the free blocks hold their prompts
   (and --max-batch allows); their prompts are prefilled together (left padded, as
   `qkvlab.decode.generate` does), copied into their blocks, and their first token is sampled;
3. grow: a sequence whose next token starts a new block takes one; when none is free, the most
   recently admitted sequence is preempted (vLLM's recompute): its blocks are given back and it
   goes back to the front of the queue with its tokens so far, which are prefilled again when it
   is readmitted; nothing admitted is lost, and it continues exactly where it was;
4. decode: one token for every running sequence in one forward pass (paged.py). On the CPU in fp32,
   while the running batch stays small the model's Linear products run in blocks, one per thread, as
   `generate` runs them (generate.DecodeLayout; switched after LAYOUT_SWITCH_STEPS steps on the other
   side of LAYOUT_MAX_BATCH, at once for a server that never ran more; given back at `stop`).

Each sequence computes exactly what `qkvlab.decode.generate` computes for it alone: the same prefill, the
same cached keys and values, each attending to its own tokens only; so greedy tokens match.
Admission is by blocks, and blocks by cache bytes: the pool holds --cache-memory / (bytes per
token x block size) blocks, so a scheme that caches less serves more tokens at once, and a short
request holds only the blocks its tokens fill. When no block is free, requests wait in the queue;
they never fail for lack of room (the pool always holds one whole context).

A request asks for `n` choices: n sequences that share one prefill of the prompt when they are
admitted together (its keys and values are copied into each one's blocks) and then decode on their
own; seeded sampling gives choice i the seed + i, so choice 0 is what n = 1 gives. With `logprobs`
each token carries its log-probability and the top-k alternatives (of the model's distribution,
before temperature, as vLLM reports them); `prompt_logprobs` does the same for the prompt (echo).

Tokens leave through each request's `emit(Event)`, called on the engine thread (the app forwards
them to its event loop). Sampling is per request: its temperature, top-k, top-p and seed. The
serving metrics (metrics.py) are observed here, where a token's time is known.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkvlab.base.errors import UserError
from qkvlab.decode.generate import (
    LAYOUT_MAX_BATCH,
    DecodeLayout,
    Sampling,
    compiled_paged_step,
    decode_step,
    left_pad,
    new_cache,
    next_token,
    prefill,
)
from qkvlab.serve.paged import BLOCK_SIZE, BlockPool, blocks_for

PREFILL_TOKENS = 4096  # padded prompt tokens prefilled in one step (at least one whole prompt): bounds a step
WARM_UP_SHAPES = ((1, [4]), (2, [2, 3]))  # (sequences, positions) compiled at start: see Engine.warm_up
LAYOUT_SWITCH_STEPS = 16  # decode steps in a row on the other side of LAYOUT_MAX_BATCH before the layout follows


class Draining(Exception):
    """The server is shutting down: no new requests (HTTP 503)."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling(temperature=0.0)
    seed: int | None = None
    n: int = 1  # choices, sharing the prompt's prefill
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    stop_ids: frozenset[int] | None = None  # None: the engine's (end of text / turn); empty: never stop on a token


TopK = tuple[tuple[int, float], ...]  # (token id, log-probability), most probable first


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


class Group:
    """The n sequences of one request: one prompt, prefilled once when they are admitted together."""

    def __init__(self, request: Request):
        self.request = request
        self.prompt_logprobs: tuple | None = None  # computed at the first prefill that asks for them


class Sequence:
    """One choice of a request inside the engine: where it is and what it may still produce."""

    def __init__(self, sid: int, group: Group, index: int, emit: Callable[[Event], None], steps: int, generator, stops):
        self.id, self.group, self.index, self.emit = sid, group, index, emit
        self.request = group.request
        self.steps = steps  # tokens it may produce (max_tokens, fewer where the context ends)
        self.generator = generator
        self.stops = stops  # token ids that end it (not emitted)
        self.table: list[int] = []  # its blocks, in order (paged.py)
        self.tokens: list[int] = []  # the tokens it emitted: with the prompt, what a preempted one recomputes
        self.produced = 0  # tokens sampled, a stop token included
        self.emitted = 0
        self.position = len(self.request.prompt)  # of the token fed next; also the columns its row has filled
        self.pending: int | None = None  # the last sampled token, fed at the next decode step
        self.cancel_reason: str | None = None
        self.done = False
        self.metrics = None  # metrics.Metrics, set by the engine
        self.arrived = time.perf_counter()
        self.first: float | None = None  # when its first token was emitted
        self.last: float | None = None

    def prefill_ids(self) -> list[int]:
        """What admitting it prefills: the prompt, and after a preemption the tokens it emitted
        (the last one is the token it was about to feed, so the prefill's logits give the next)."""
        return [*self.request.prompt, *self.tokens]

    def prefill_key(self):
        """Sequences with one key share a prefill: a request's fresh choices (its group)."""
        return self if self.tokens else self.group

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            if self.metrics is not None:
                self.metrics.finished(self, reason, time.perf_counter())
            self.emit(Event(finish=reason, index=self.index))


class Engine:
    def __init__(
        self,
        model,
        rows: int | None = None,
        *,
        blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        eot_id: int | None = None,
        stop_ids=(),
        vocab_limit: int | None = None,
        context: int | None = None,
        metrics=None,
        compile: str | None = None,
    ):
        """rows: most sequences at once (None: as many as the blocks hold); blocks: of the pool
        (default: `rows` whole contexts); stop_ids (and eot_id, the same with one id): tokens that
        end a sequence unless its request says otherwise; context: the longest sequence served
        (--max-model-len), at most the model's; compile: a torch.compile mode (default or max-autotune)
        to decode with `compiled_paged_step` in (call `warm_up` before serving, so no request waits for
        the compiler), the decode layout held throughout (a new hold would be new objects in the
        compiled graph: a recompile)."""
        self.model, self.vocab_limit, self.metrics = model, vocab_limit, metrics
        self.stop_ids = frozenset(stop_ids) | ({eot_id} if eot_id is not None else set())
        self.context = model.cfg.context if context is None else context
        if not 1 <= self.context <= model.cfg.context:
            raise UserError(
                f"max_model_len={self.context} must be from 1 to the model's context of {model.cfg.context}"
            )
        per_context = blocks_for(self.context, block_size)
        if blocks is None:
            if rows is None:
                raise UserError("give the engine rows or blocks")
            blocks = rows * per_context
        if blocks < per_context:  # then a sequence of a whole context could never finish
            raise UserError(f"{blocks} blocks of {block_size} tokens hold no sequence of {self.context} tokens")
        self.max_batch = rows if rows is not None else blocks
        self.device = next(model.parameters()).device
        self.pool = BlockPool(model, blocks, block_size)
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.waiting: deque[Sequence] = deque()
        self.cv = threading.Condition()  # guards waiting, draining, counters; wakes the loop
        self.draining = self._stopping = False
        self.active = self.peak_active = self.tokens = self.finished = self.preemptions = 0
        self.peak_blocks = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        # generate's small-batch weight layout (generate.DecodeLayout; CPU, fp32): held while the running
        # batch stays at most LAYOUT_MAX_BATCH, released while it stays above, each switch after
        # LAYOUT_SWITCH_STEPS steps on the other side (a hold copies the Linear weights once)
        self.layout = DecodeLayout(model)
        self._layout_applies = DecodeLayout.applies(model)
        self._layout_votes = 0
        self._decode_step = compiled_paged_step(self.device, compile) if compile else decode_step
        if compile:  # above LAYOUT_MAX_BATCH rows a PackedProduct calls the Linear's own product
            self.layout.hold(min(self.max_batch, LAYOUT_MAX_BATCH))

    @property
    def capacity_sequences(self) -> int:
        """Sequences of a whole context the pool holds at once (at most max_batch)."""
        return min(self.max_batch, self.pool.blocks // blocks_for(self.context, self.pool.block_size))

    @property
    def max_concurrency(self) -> float:
        """vLLM's figure: the pool's tokens / the context (full-length requests at once)."""
        return self.pool.tokens / self.context

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request: Request, emit: Callable[[Event], None]) -> Sequence:
        """Queue a one-choice request (UserError for a bad one, Draining while shutting down)."""
        if request.n != 1:
            raise UserError(f"n={request.n}: use submit_all for more than one choice")
        return self.submit_all(request, emit)[0]

    def submit_all(self, request: Request, emit: Callable[[Event], None]) -> list[Sequence]:
        """Queue a request's n choices, one sequence each (their events carry their index)."""
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise UserError(f"max_tokens={request.max_tokens!r} must be an integer >= 1")
        if isinstance(request.n, bool) or not isinstance(request.n, int) or request.n < 1:
            raise UserError(f"n={request.n!r} must be an integer >= 1")
        self.check_prompt(request.prompt)
        request.sampling.validate()
        steps = min(request.max_tokens, self.context + 1 - len(request.prompt))  # as generate.max_steps
        stops = self.stop_ids if request.stop_ids is None else frozenset(request.stop_ids)
        group = Group(request)
        with self.cv:
            if self.draining:
                raise Draining("the server is shutting down")
            seqs = []
            for i in range(request.n):
                seq = Sequence(next(self._ids), group, i, emit, steps, self._generator(request, i), stops)
                seq.metrics = self.metrics
                seqs.append(seq)
            self.waiting.extend(seqs)
            self.cv.notify_all()
        return seqs

    def check_prompt(self, prompt) -> None:
        if len(prompt) == 0:
            raise UserError("empty prompt: give at least one token to start from")
        if len(prompt) > self.context:
            raise UserError(f"prompt of {len(prompt):,} tokens is longer than the model's context of {self.context:,}")
        bad = [t for t in prompt if not 0 <= int(t) < self.model.cfg.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.cfg.vocab_size})")

    def _generator(self, request: Request, index: int) -> torch.Generator | None:
        if request.sampling.greedy:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(request.seed + index) if request.seed is not None else generator.seed()
        return generator

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
                "capacity_sequences": self.capacity_sequences,
                "capacity_tokens": self.pool.tokens,
                "max_concurrency": round(self.max_concurrency, 2),
                "block_size": self.pool.block_size,
                "blocks": self.pool.blocks,
                "blocks_used": self.pool.used,
                "peak_blocks_used": self.peak_blocks,
                "preemptions": self.preemptions,
                "max_batch": self.max_batch,
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
        self.layout.release()  # the model's own weights, as they were

    @property
    def compiled(self) -> bool:
        return self._decode_step is not decode_step

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile the decode step before serving (WARM_UP_SHAPES), on blocks taken from the pool and
        given back -> seconds; 0 when the engine decodes eager."""
        if not self.compiled:
            return 0.0
        t0 = time.perf_counter()
        need = blocks_for(5, self.pool.block_size)  # a sequence up to position 4
        if self.pool.blocks - self.pool.used < 2 * need:
            raise UserError("the cache pool is too small to compile the decode step on (2 sequences of 5 tokens)")
        tables = [self.pool.take(need) for _ in range(2)]
        # one sequence first: its graph keeps the batch of 1 as a constant (torch specializes sizes of 1)
        # and the length symbolic; then two, whose graph is symbolic in both (started the other way
        # round, dynamo kept the first graph's sizes fixed and needed a third)
        for n, positions in WARM_UP_SHAPES:
            tokens = torch.zeros(n, dtype=torch.long, device=self.device)
            step = self.pool.step(tables[:n], positions)
            self._decode_step(self.model, step, tokens, torch.tensor(positions, device=self.device))
        for t in tables:
            self.pool.give_back(t)
        return time.perf_counter() - t0

    def _follow_layout(self, batch: int) -> None:
        """Hold or release the decode layout for a running batch of `batch` rows (see __init__)."""
        if self.compiled or not self._layout_applies or self.layout.held == (batch <= LAYOUT_MAX_BATCH):
            self._layout_votes = 0
            return
        self._layout_votes += 1
        if self.layout.held:
            if self._layout_votes >= LAYOUT_SWITCH_STEPS:
                self.layout.release()
                self._layout_votes = 0
        elif self._layout_votes >= LAYOUT_SWITCH_STEPS or not self.waiting and self.peak_active <= LAYOUT_MAX_BATCH:
            self.layout.hold(batch)
            self._layout_votes = 0

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
        """Retire, admit, grow, decode once. A failure ends the sequences it touched, never the engine."""
        try:
            self._retire()
            admitted = self._admit()
            if admitted:
                try:
                    logits = self._prefill(admitted)
                finally:
                    self.running += admitted
                self._sample(logits, admitted)
                self._retire()
            self._grow()
            if self.running:
                self._decode()
        except Exception:  # noqa: BLE001 (a bug or an out-of-memory must not stop the server)
            traceback.print_exc(file=sys.stderr)
            for seq in self.running:
                seq.finish("error")
        finally:
            self._retire()
            with self.cv:
                self.active = len(self.running)
                self.peak_active = max(self.peak_active, self.active)
                self.peak_blocks = max(self.peak_blocks, self.pool.used)
                self.cv.notify_all()

    def _retire(self) -> None:
        """Drop finished and cancelled sequences; their blocks go back to the pool."""
        keep = []
        for seq in self.running:
            if seq.cancel_reason is not None:
                seq.finish(seq.cancel_reason)
            if seq.done:
                self.pool.give_back(seq.table)
                with self.cv:
                    self.finished += 1
            else:
                keep.append(seq)
        self.running[:] = keep

    def _admit(self) -> list[Sequence]:
        """Waiting sequences, first come first served, while free blocks hold what each must
        prefill (its prompt, and a preempted one's tokens so far) and --max-batch allows; up to
        PREFILL_TOKENS padded tokens (a group's prompt counted once: its choices share it)."""
        out: list[Sequence] = []
        keys: dict[object, int] = {}
        with self.cv:
            while self.waiting and len(self.running) + len(out) < self.max_batch:
                nxt = self.waiting[0]
                length = len(nxt.prefill_ids())
                key = nxt.prefill_key()
                if out and key not in keys:
                    if max(length, *keys.values()) * (len(keys) + 1) > PREFILL_TOKENS:
                        break
                table = self.pool.take(blocks_for(length, self.pool.block_size))
                if table is None:
                    break  # first come first served: nobody overtakes the head of the queue
                nxt.table = table
                keys.setdefault(key, length)
                out.append(self.waiting.popleft())
            self.active = len(self.running) + len(out)  # busy from leaving the queue on
            self.peak_active = max(self.peak_active, self.active)
        return out

    def _grow(self) -> None:
        """Give each running sequence the block its next token falls in, preempting the most
        recently admitted ones (recompute) while none is free."""
        B = self.pool.block_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.position // B < len(seq.table):
                i += 1
                continue
            block = self.pool.take(1)
            if block is not None:
                seq.table += block
                i += 1
                continue
            self._preempt(self.running.pop())  # the last admitted; may be seq itself (then i is past the end)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.give_back(seq.table)
        seq.position = len(seq.request.prompt)  # it restarts from a prefill of prompt + tokens
        with self.cv:
            self.waiting.appendleft(seq)
            self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted()

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each group's prompt once (a preempted sequence's prompt and tokens on their own), left
        padded into a scratch cache, then its real tokens into each of its sequences' blocks ->
        logits (len(seqs), V) after each one's last token."""
        keys = list(dict.fromkeys(s.prefill_key() for s in seqs))
        first = {}
        for s in seqs:
            first.setdefault(s.prefill_key(), s)
        prompts = [tuple(first[k].prefill_ids()) for k in keys]
        groups = [first[k].group if not first[k].tokens else None for k in keys]  # None: a recompute
        batch = left_pad(prompts, device=self.device)
        T = batch.idx.shape[1]
        scratch = new_cache(self.model, len(prompts), T)
        wants = [g is not None and g.request.prompt_logprobs is not None and g.prompt_logprobs is None for g in groups]
        if any(wants):
            every, _ = self.model(batch.idx, cache=scratch, positions=batch.positions, token_mask=batch.token_mask)
            for j, g in enumerate(groups):  # every (G, T, V): logits after each prompt token
                if wants[j]:
                    g.prompt_logprobs = self._prompt_logprobs(every[j, T - len(prompts[j]) :], prompts[j], g)
            logits = every[:, -1]
        else:
            logits = prefill(self.model, scratch, batch)
        row = {k: j for j, k in enumerate(keys)}
        for s in seqs:
            j = row[s.prefill_key()]
            self.pool.load(s.table, scratch, j, T - len(prompts[j]), len(prompts[j]))
            s.position = len(prompts[j])
        return logits[[row[s.prefill_key()] for s in seqs]]

    def _prompt_logprobs(self, logits: torch.Tensor, prompt, group: Group) -> tuple:
        """logits (L, V) after each of the prompt's L tokens -> per token (logprob, top k), the first None."""
        ids = torch.tensor(prompt[1:], device=logits.device)
        chosen, top = self._logprobs(logits[:-1], ids, group.request.prompt_logprobs)
        return ((None, None), *zip(chosen, top))

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[list[float], list[TopK]]:
        """logits (B, V), tokens (B,) -> each token's log-probability and the k most probable, of the
        model's distribution over the ids the tokenizer has."""
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits = logits[..., : self.vocab_limit]
        lp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)  # bf16 would round them
        chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
        if k == 0:
            return chosen, [() for _ in chosen]
        values, ids = lp.topk(min(k, lp.shape[-1]), -1)
        return chosen, [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def _decode(self) -> None:
        self._follow_layout(len(self.running))
        tokens = torch.tensor([s.pending for s in self.running], device=self.device)
        positions = [s.position for s in self.running]
        step = self.pool.step([s.table for s in self.running], positions)
        logits = self._decode_step(self.model, step, tokens, torch.tensor(positions, device=self.device))
        for s in self.running:
            s.position += 1
        self._sample(logits, self.running)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits (B, V) of seqs -> each one's next token, emitted (a stop token is not)."""
        tokens = next_token(logits, Sampling(temperature=0.0), vocab_limit=self.vocab_limit).tolist()
        for j, s in enumerate(seqs):
            if not s.request.sampling.greedy:
                try:
                    tokens[j] = int(next_token(logits[j : j + 1], s.request.sampling, s.generator, self.vocab_limit)[0])
                except RuntimeError:  # e.g. a temperature so small the probabilities overflow: this one only
                    s.finish("error")
        want = [j for j, s in enumerate(seqs) if s.request.logprobs is not None and not s.done]
        scored: dict[int, tuple[float, TopK]] = {}
        if want:
            k = max(seqs[j].request.logprobs for j in want)
            chosen, top = self._logprobs(logits[want], torch.tensor([tokens[j] for j in want], device=self.device), k)
            scored = {j: (c, t[: seqs[j].request.logprobs]) for j, c, t in zip(want, chosen, top)}
        emitted, now = 0, time.perf_counter()
        for j, (s, t) in enumerate(zip(seqs, tokens)):
            if s.done:
                continue
            s.produced += 1
            if t in s.stops:
                s.finish("stop")
                continue
            s.pending = t
            lp, top = scored.get(j, (None, None))
            prompt = s.group.prompt_logprobs if s.produced == 1 and s.request.prompt_logprobs is not None else None
            if self.metrics is not None:
                self.metrics.token(s, now)
            s.first = s.first or now
            s.last, s.emitted = now, s.emitted + 1
            s.tokens.append(t)
            s.emit(Event(token=t, index=s.index, logprob=lp, top=top, prompt=prompt))
            emitted += 1
            if s.produced >= s.steps:
                s.finish("length")
        with self.cv:
            self.tokens += emitted
