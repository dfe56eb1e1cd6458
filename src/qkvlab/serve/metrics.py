"""GET /metrics: Prometheus text format through prometheus_client, in vLLM's names, so the
dashboards and alerts written for vLLM read qkvlab unchanged.

Gauges are read when scraped (the engine's counts); latencies are observed by the engine thread
when a token is emitted, which is when its time is known:

- vllm:time_to_first_token_seconds: arrival to the first token;
- vllm:inter_token_latency_seconds: between consecutive tokens of one sequence (also under its
  older name vllm:time_per_output_token_seconds, as vLLM still exports it);
- vllm:request_time_per_output_token_seconds: per request, (last - first token) / (tokens - 1);
- vllm:e2e_request_latency_seconds: arrival to the end;
- vllm:num_preemptions_total: sequences preempted (recompute) for want of a free block;
- vllm:kv_cache_usage_perc: blocks in use / blocks (a fraction from 0 to 1, as vLLM's);
- vllm:prefix_cache_queries, vllm:prefix_cache_hits: prompt tokens looked up in the prefix cache at
  admission, and tokens found (counters, as vLLM's v1 names them).

Each app has its own registry: tests run several servers in one process.
"""

from __future__ import annotations

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms from either server compare bucket by bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    content_type = CONTENT_TYPE

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # optional: prometheus_client

        self.registry = reg = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": reg}
        self.name = model_name

        def hist(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **label).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "Sequences in the running batch.", **label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting for a cache row.", **label)
        self.usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", **label)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.tpot_old = hist("vllm:time_per_output_token_seconds", "Inter-token latency (older name).", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds", "Per request: decode time per output token.", ITL_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute).", **label).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled.", **label).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", **label).labels(model_name)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", **label)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", **label)
        self.cache_seen = (0, 0)
        self.success = Counter(
            "vllm:request_success", "Finished sequences by reason.", ["model_name", "finished_reason"], registry=reg
        )

    def watch(self, engine) -> None:
        """Read the engine's counts at each scrape."""
        kv = engine.kv
        self.running.labels(self.name).set_function(lambda: engine.active)
        self.waiting.labels(self.name).set_function(lambda: len(engine.scheduler.waiting))
        self.usage.labels(self.name).set_function(lambda: kv.usage)

    # ---- observed by the engine ---------------------------------------------------------------
    def token(self, seq, now: float) -> None:
        if seq.first is None:
            self.ttft.observe(now - seq.arrived)
            if seq.index == 0:
                self.prompt_tokens.inc(seq.prompt_len)
        else:
            self.itl.observe(now - seq.last)
            self.tpot_old.observe(now - seq.last)
        self.generation_tokens.inc()

    def prefix_cache(self, queries: int, hits: int) -> None:
        """The cache manager's running totals: what grew since the last call is counted."""
        q0, h0 = self.cache_seen
        if queries > q0:
            self.cache_queries.labels(self.name).inc(queries - q0)
        if hits > h0:
            self.cache_hits.labels(self.name).inc(hits - h0)
        self.cache_seen = (queries, hits)

    def preempted(self) -> None:
        self.preemptions.inc()

    def finished(self, seq, reason: str, now: float) -> None:
        self.e2e.observe(now - seq.arrived)
        if seq.first is not None and seq.emitted > 1:
            self.tpot.observe((seq.last - seq.first) / (seq.emitted - 1))
        self.success.labels(self.name, reason if reason in ("stop", "length") else "abort").inc()  # vLLM's three

    def text(self) -> bytes:
        from prometheus_client import generate_latest  # optional: prometheus_client

        return generate_latest(self.registry)
