"""`qkvlab serve`: an OpenAI/vLLM-compatible endpoint with continuous batching on a paged, spec-sized KV cache.

- paged.py: the cache as a pool of fixed-size blocks, a block table per sequence;
- engine.py: the scheduler and step loop (admit by free blocks, prefill, grow or preempt, one
  decode step for all), n choices sharing a prefill, log-probabilities;
- tokens.py: the model's own tokenizer (transformers' or qkvlab's), its stop ids and chat template;
- protocol.py: the OpenAI/vLLM request schemas, response shapes and incremental text with stop strings;
- app.py: the FastAPI routes (completions, chat, models, tokenize, health, metrics), errors as JSON;
- metrics.py: Prometheus metrics in vLLM's names;
- server.py: ServeConfig, capacity from --cache-memory, uvicorn with a SIGTERM drain.

The engine knows tokens only, not HTTP; the app knows HTTP only, not tensors.
"""
