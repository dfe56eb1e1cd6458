"""`qkvlab serve`: an OpenAI/vLLM-compatible endpoint with continuous batching on a paged, spec-sized KV cache.

The engine, in vLLM's rooms:
- scheduler.py: admission by free blocks, chunked prefill under a token budget, preemption by recompute;
- kv_cache_manager.py: the block pool, block tables and automatic prefix caching;
- runner.py: one forward per step over prefill chunks and decodes, on the paged storage (paged.py):
  decode steps read their blocks in place (paged_attention.py), other steps gather;
- sampler.py: greedy, temperature/top-k/top-p, seeds, penalties, log-probabilities;
- engine.py drives them a step at a time on its thread (request.py: what it is asked and answers);
- decoding.py: the decoding choices (dtype and layout as decode.choices.DecodeChoices, the layout's
  tree, the compiled step, the paged read), made once by server.load_served.

The HTTP side talks to the engine through async_engine.py only: app.py (routes), prompts.py (bodies
to token ids, off the event loop), job.py (responses), served.py, protocol.py, tokens.py, metrics.py;
server.py: ServeConfig, the model loaded (load_served), the pool sized and the app built (build),
uvicorn with a SIGTERM drain.
"""
