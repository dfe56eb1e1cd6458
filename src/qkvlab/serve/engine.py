"""The engine: continuous batching over the paged KV cache, its four rooms driven one step at a time.

- scheduler.py decides which sequences compute which tokens (admission by free blocks, chunked
  prefill under a token budget, preemption by recompute);
- kv_cache_manager.py holds the blocks (tables, prefix cache);
- runner.py runs one forward over the step's work on the paged storage;
- sampler.py turns each finished chunk's logits into a token (and log-probabilities).

One step (`Engine.step`), on the engine's own thread, never on an event loop: retire finished and
cancelled sequences (their blocks back), schedule, run, sample, emit. A failure ends the sequences
it touched, never the engine. Tokens leave through each request's `emit(Event)`, called on the
engine thread; the serving metrics (metrics.py) are observed here, where a token's time is known.
The engine knows tokens only: async_engine.py is what an event loop talks to.

Admission is by blocks, and blocks by cache bytes: the pool holds --cache-memory / (bytes per token x
block size) blocks, so a scheme that caches less serves more tokens at once, and a short request
holds only the blocks its tokens fill. When no block is free, requests wait in the queue; they never
fail for lack of room (the pool always holds one whole context).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from qkvlab.base.errors import UserError
from qkvlab.serve.decoding import RunnerDecoding, runner_decoding
from qkvlab.serve.kv_cache_manager import KVCacheManager, blocks_for, default_block_size
from qkvlab.serve.request import Draining, Event, Request, Sequence
from qkvlab.serve.runner import ModelRunner
from qkvlab.serve.sampler import Sampler
from qkvlab.serve.scheduler import Scheduler, Work

TOKEN_BUDGET = 512  # tokens one step computes at most (decodes always go): --max-num-batched-tokens


class Engine:
    def __init__(
        self,
        model,
        rows: int | None = None,
        *,
        blocks: int | None = None,
        block_size: int | None = None,
        eot_id: int | None = None,
        stop_ids=(),
        vocab_limit: int | None = None,
        context: int | None = None,
        metrics=None,
        choices: RunnerDecoding | None = None,
        token_budget: int = TOKEN_BUDGET,
        prefix_caching: bool = True,
    ):
        """rows: most sequences at once (None: as many as the blocks hold); blocks: of the pool
        (default: `rows` whole contexts); block_size: tokens per block (default: the device's,
        `default_block_size`); stop_ids (and eot_id, the same with one id): tokens that
        end a sequence unless its request says otherwise; context: the longest sequence served
        (--max-model-len), at most the model's; choices: the decoding choices (default: the model's
        dtype, the layout chosen for its rows, eager, read in place); token_budget: tokens a step
        computes at most."""
        self.vocab_size, self.metrics = model.cfg.vocab_size, metrics
        self.stop_ids = frozenset(stop_ids) | ({eot_id} if eot_id is not None else set())
        self.context = model.cfg.context if context is None else context
        if not 1 <= self.context <= model.cfg.context:
            raise UserError(
                f"max_model_len={self.context} must be from 1 to the model's context of {model.cfg.context}"
            )
        self.device = next(model.parameters()).device
        block_size = block_size or default_block_size(self.device.type)
        per_context = blocks_for(self.context, block_size)
        if blocks is None:
            if rows is None:
                raise UserError("give the engine rows or blocks")
            blocks = rows * per_context
        if blocks < per_context:  # then a sequence of a whole context could never finish
            raise UserError(f"{blocks} blocks of {block_size} tokens hold no sequence of {self.context} tokens")
        if token_budget < 1:
            raise UserError(f"max_num_batched_tokens={token_budget} must be at least 1")
        self.max_batch = rows if rows is not None else blocks
        self.choices = choices if choices is not None else runner_decoding(model, rows=self.max_batch)
        self.kv = KVCacheManager(blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.kv, self.max_batch, token_budget)
        self.scheduler.on_preempt = lambda seq: metrics.preempted() if metrics is not None else None
        self.runner = ModelRunner(model, blocks, block_size, self.choices)
        self.sampler = Sampler(vocab_limit)
        self.cv = threading.Condition()  # guards the scheduler's queues and the counters; wakes the loop
        self.draining = self._stopping = False
        self.active = self.peak_active = self.tokens = self.finished = 0
        self.peak_blocks = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.watch(self)  # its gauges read the running, waiting and block counts at each scrape

    @property
    def model(self):
        return self.runner.model

    @property
    def vocab_limit(self) -> int | None:
        return self.sampler.vocab_limit

    @property
    def capacity_sequences(self) -> int:
        """Sequences of a whole context the pool holds at once (at most max_batch)."""
        return min(self.max_batch, self.kv.blocks // blocks_for(self.context, self.kv.block_size))

    @property
    def max_concurrency(self) -> float:
        """vLLM's figure: the pool's tokens / the context (full-length requests at once)."""
        return self.kv.tokens / self.context

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request: Request, emit: Callable[[Event], None]) -> Sequence:
        """Queue a one-choice request (UserError for a bad one, Draining while shutting down)."""
        if request.n != 1:
            raise UserError(f"n={request.n}: use submit_all for more than one choice")
        return self.submit_all(request, emit)[0]

    def submit_all(self, request: Request, emit: Callable[[Event], None]) -> list[Sequence]:
        """Queue a request's n choices, one sequence each (their events carry their index)."""
        for name in ("max_tokens", "n"):
            value = getattr(request, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name}={value!r} must be an integer >= 1")
        self.check_prompt(request.prompt)
        request.sampling.validate()
        steps = min(request.max_tokens, self.context + 1 - len(request.prompt))  # as generate.max_steps
        stops = self.stop_ids if request.stop_ids is None else frozenset(request.stop_ids)
        with self.cv:
            if self.draining:
                raise Draining("the server is shutting down")
            seqs = [Sequence(next(self._ids), request, i, emit, steps, stops, self.device) for i in range(request.n)]
            for seq in seqs:
                seq.metrics = self.metrics
            self.scheduler.waiting.extend(seqs)
            self.cv.notify_all()
        return seqs

    def check_prompt(self, prompt) -> None:
        if len(prompt) == 0:
            raise UserError("empty prompt: give at least one token to start from")
        if len(prompt) > self.context:
            raise UserError(f"prompt of {len(prompt):,} tokens is longer than the model's context of {self.context:,}")
        bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence: a queued one leaves now, a running one frees its blocks at the next step."""
        with self.cv:
            seq.cancel_reason = seq.cancel_reason or reason
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
                seq.finish(reason)
            self.cv.notify_all()

    def stats(self) -> dict[str, int]:
        with self.cv:
            kv = self.kv
            return {
                "capacity_sequences": self.capacity_sequences,
                "capacity_tokens": kv.tokens,
                "max_concurrency": round(self.max_concurrency, 2),
                "block_size": kv.block_size,
                "blocks": kv.blocks,
                "blocks_used": kv.used,
                "peak_blocks_used": self.peak_blocks,
                "prefix_cache_queries": kv.queries,
                "prefix_cache_hits": kv.hits,
                "preemptions": self.scheduler.preemptions,
                "max_batch": self.max_batch,
                "max_num_batched_tokens": self.scheduler.token_budget,
                "active": self.active,
                "queued": len(self.scheduler.waiting),
                "peak_active": self.peak_active,
                "tokens_generated": self.tokens,
                "requests_finished": self.finished,
            }

    def idle(self) -> bool:
        return self.active == 0 and not self.scheduler.waiting

    def begin_drain(self) -> None:
        with self.cv:
            self.draining = True

    def wait_idle(self, timeout: float | None) -> bool:
        with self.cv:
            return self.cv.wait_for(self.idle, timeout)

    def abort_all(self, reason: str = "shutdown") -> None:
        with self.cv:
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
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

    def warm_up(self) -> float:
        """Compile before serving what the runner compiles (the decode step, or the paged read) -> seconds."""
        return self.runner.warm_up()

    def _loop(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self._stopping or self.scheduler.waiting or self.scheduler.running)
                if self._stopping:
                    return
            self.step()

    # ---- the step, on the engine thread --------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Retire, schedule, run, sample once. A failure ends the sequences it touched, never the engine."""
        try:
            self._retire()
            with self.cv:
                work = self.scheduler.schedule()
                self.active = len(self.scheduler.running)
                self.peak_active = max(self.peak_active, self.active)
            if self.metrics is not None:
                self.metrics.prefix_cache(self.kv.queries, self.kv.hits)
            if work:
                self._run(work)
        except Exception:  # noqa: BLE001 (a bug or an out-of-memory must not stop the server)
            traceback.print_exc(file=sys.stderr)
            for seq in self.scheduler.running:
                seq.finish("error")
            self.kv.reset_prefix_cache()  # blocks registered this step may not hold what their keys say
        finally:
            self._retire()
            with self.cv:
                self.active = len(self.scheduler.running)
                self.peak_active = max(self.peak_active, self.active)
                self.peak_blocks = max(self.peak_blocks, self.kv.used)
                self.cv.notify_all()

    def _retire(self) -> None:
        """Drop finished and cancelled sequences; their blocks go back to the pool."""
        with self.cv:
            for seq in list(self.scheduler.running):
                if seq.cancel_reason is not None:
                    seq.finish(seq.cancel_reason)
                if seq.done:
                    self.scheduler.retire(seq)
                    self.finished += 1

    def _run(self, work: list[Work]) -> None:
        every = {
            i for i, w in enumerate(work) if w.seq.request.prompt_logprobs is not None and w.start < w.seq.prompt_len
        }
        last, all_logits = self.runner.execute(work, every)
        for i in every:
            self.sampler.prompt_logprobs(all_logits[i], work[i].seq, work[i].start)
        for w in work:
            w.seq.computed += w.count
        done = [j for j, w in enumerate(work) if w.samples]
        if done:
            self._emit(last[done], [work[j].seq for j in done])

    def _emit(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits (B, V) of seqs -> each one's next token, emitted (a stop token is not)."""
        tokens = self.sampler.sample(logits, seqs)
        scored = self._scored(logits, seqs, tokens)
        emitted, now = 0, time.perf_counter()
        for j, (s, t) in enumerate(zip(seqs, tokens)):
            if t is None:
                s.finish("error")
                continue
            s.produced += 1
            if t in s.stops:
                s.finish("stop", t)
                continue
            lp, top = scored.get(j, (None, None))
            prompt = tuple(s.prompt_lp) if s.produced == 1 and s.request.prompt_logprobs is not None else None
            if self.metrics is not None:
                self.metrics.token(s, now)
            s.first = s.first or now
            s.last = now
            s.tokens.append(t)
            s.counts[t] = s.counts.get(t, 0) + 1
            s.emit(Event(token=t, index=s.index, logprob=lp, top=top, prompt=prompt))
            emitted += 1
            if s.produced >= s.steps:
                s.finish("length")
        with self.cv:
            self.tokens += emitted

    def _scored(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int | None]) -> dict:
        """Row j -> (log-probability, top k) of its token, for the sequences that asked."""
        want = [j for j, s in enumerate(seqs) if s.request.logprobs is not None and tokens[j] is not None]
        if not want:
            return {}
        k = max(seqs[j].request.logprobs for j in want)
        ids = torch.tensor([tokens[j] for j in want], device=logits.device)
        chosen, top = self.sampler.logprobs(logits[want], ids, k)
        return {j: (c, t[: seqs[j].request.logprobs]) for j, c, t in zip(want, chosen, top)}
