"""qkvlab.decode.speed: the bytes a decode step reads (against the analytic counts) and the timing helpers."""

from __future__ import annotations

import pytest
import torch

from qkvlab.decode.speed import (
    bandwidth_limit_step_s,
    best_of,
    cache_bytes_per_token,
    copy_rate,
    time_decode,
    weight_bytes_per_step,
)
from qkvlab.model.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT


def small(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, d_model=32, vocab_size=64, context=32)
    return ModelConfig(**{**base, **kw}).validate()


@pytest.mark.parametrize(
    "kw",
    [
        dict(attn="Q-K-V"),
        dict(attn="Q-K=V", kv_heads=1, tie_embeddings=False),
        dict(attn="Id-K=V", pos="learned", bias=True),
        dict(attn="(Q=K-V)+", pos="rope", tie_embeddings=False),
    ],
)
def test_bytes_read_per_step_match_the_analytic_counts(kw):
    cfg = small(**kw)
    model = GPT(cfg)
    # every non-embedding weight once, plus the output head (vocab x d), tied or not; embedding rows: ~0
    expected = 4 * (analytic_params(cfg).non_embedding + cfg.vocab_size * cfg.d_model)
    assert weight_bytes_per_step(model) == expected
    assert cache_bytes_per_token(model) == kv_cache_bytes_per_token(cfg, "fp32")
    rate = 1e9
    limit = bandwidth_limit_step_s(model, 3, 10.5, rate)
    assert limit == pytest.approx((expected + 3 * 10.5 * kv_cache_bytes_per_token(cfg, "fp32")) / rate)


def test_time_decode_times_prefill_and_steps_apart():
    torch.set_num_threads(1)
    model = GPT(small()).eval()
    prompt = torch.randint(0, 64, (2, 9))
    runs = [time_decode(model, prompt, 5, mode) for mode in ("dynamic", "static", "dynamic")]
    for t in runs:
        assert t.prefill_s > 0 and t.step_s > 0 and t.compile_s is None
        assert t.prefill_tokens_per_s == pytest.approx(2 * 9 / t.prefill_s)
        assert t.decode_tokens_per_s == pytest.approx(2 / t.step_s)
        assert t.end_to_end_tokens_per_s == pytest.approx(2 * 5 / (t.prefill_s + 4 * t.step_s))
    best = best_of(runs)
    assert best.step_s == min(t.step_s for t in runs) and best.prefill_s == min(t.prefill_s for t in runs)
    one = time_decode(model, prompt, 1)  # no decode step to time: unmeasured, never a rate of nothing
    assert one.step_s is None and one.decode_tokens_per_s is None and one.end_to_end_tokens_per_s is None
    assert copy_rate(nbytes=2**20, seconds=0.01) > 0
