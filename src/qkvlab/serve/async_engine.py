"""The one interface an event loop has to the engine: submit requests, read their events, cancel.

The engine steps on its own thread and calls each sequence's `emit` there; a `Stream` hands those
events to the event loop that opened it (call_soon_threadsafe into an asyncio.Queue), so a route
awaits tokens and never blocks. Nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio

from qkvlab.serve.engine import Engine
from qkvlab.serve.request import Event, Request, Sequence


class Stream:
    """The events of a list of requests' choices, as (index, Event): request i's choice j is index
    i * n + j (OpenAI's order)."""

    def __init__(self, engine: Engine, requests: list[Request]):
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.seqs: list[Sequence] = []
        loop = asyncio.get_running_loop()

        def emitter(base: int):
            def emit(event: Event) -> None:  # on the engine thread
                try:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (base + event.index, event))
                except RuntimeError:  # the event loop has closed: nobody is listening any more
                    pass

            return emit

        try:
            for i, request in enumerate(requests):
                self.seqs += engine.submit_all(request, emitter(i * request.n))
        except Exception:
            self.cancel()
            raise

    async def next(self) -> tuple[int, Event]:
        return await self.queue.get()

    def cancel(self, reason: str = "cancelled", index: int | None = None) -> None:
        """End every choice (or the one at `index`) that has not ended."""
        for i, seq in enumerate(self.seqs):
            if (index is None or i == index) and not seq.done:
                self.engine.cancel(seq, reason)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, requests: list[Request]) -> Stream:
        """Queue the requests (UserError for a bad one, engine.Draining while shutting down)."""
        return Stream(self.engine, requests)

    @property
    def draining(self) -> bool:
        return self.engine.draining

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.engine.stop_ids

    def stats(self) -> dict:
        return self.engine.stats()
