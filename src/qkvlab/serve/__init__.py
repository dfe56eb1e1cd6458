"""`qkvlab serve`: an OpenAI-compatible endpoint with continuous batching on the spec-sized KV cache.

- slots.py: the cache as a fixed pool of rows, one per running sequence, each at its own length;
- engine.py: the scheduler and step loop (admit by free rows, prefill, one decode step for all);
- protocol.py: the OpenAI request schema, response shapes and incremental text with stop strings;
- app.py: the FastAPI routes (completions with SSE streaming, models, health), errors as JSON;
- server.py: ServeConfig, capacity from --cache-memory, uvicorn with a SIGTERM drain.

The engine knows tokens only, not HTTP; the app knows HTTP only, not tensors.
"""
