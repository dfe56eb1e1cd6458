"""benchmarks/serve_load.py: vLLM's serving metrics from plain timestamps with known answers (TTFT,
TPOT, ITL one per chunk, E2EL, throughputs, goodput, percentiles), the workload's lengths and arrivals,
the loopback-only endpoint, and two short end-to-end runs on a tiny random model: an --endpoint
someone else started (in this process) with text prompts, and --serve starting `qkvlab serve`.
Only correctness is asserted, never speed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from qkvlab.base.errors import UserError  # noqa: E402
from qkvlab.model.folder import save_model  # noqa: E402
from test_serve import Running, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
sl = sys.modules["serve_load"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(sl)


def record(sent, chunks, usage_tokens=None, error=None):
    usage = None if usage_tokens is None else {"completion_tokens": usage_tokens}
    return {"sent": sent, "chunks": chunks, "usage": usage, "error": error}


# ---- metric arithmetic --------------------------------------------------------------------------
def test_stat_is_numpys_linear_percentiles():
    s = sl.stat([4.0, 1.0, 3.0, 2.0])
    assert s["mean"] == 2.5 and s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97)  # 1 + 0.9 * 3, 1 + 0.99 * 3
    assert sl.stat([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_one_token_per_chunk():
    lat = sl.request_latencies(10.0, [10.5, 10.7, 11.0, 11.5], 4)
    assert lat["ttft"] == pytest.approx(0.5) and lat["e2el"] == pytest.approx(1.5)
    assert lat["tpot"] == pytest.approx(1.0 / 3)  # (1.5 - 0.5) / (4 - 1)
    assert lat["itl"] == pytest.approx([0.2, 0.3, 0.5])


def test_a_multi_token_chunk_is_one_itl_and_tpot_counts_its_tokens():
    """vLLM's client: one ITL per chunk (the gap is not spread); TPOT divides by the usage's tokens."""
    lat = sl.request_latencies(0.0, [1.0, 1.4, 1.6], 6)  # chunks of 1, 3 and 2 tokens
    assert lat["itl"] == pytest.approx([0.4, 0.2])
    assert lat["tpot"] == pytest.approx(0.6 / 5)
    assert sl.request_latencies(0.0, [0.3], 1)["tpot"] is None  # one token: no TPOT


def test_output_tokens_from_usage_else_the_chunks():
    assert sl.output_token_count(record(0, [(1, 1), (2, 3)], usage_tokens=7)) == 7
    assert sl.output_token_count(record(0, [(1, 1), (2, 3)])) == 4


@pytest.mark.parametrize(
    "chunk, tokens",
    [
        ({"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": None}]}, 2),  # qkvlab, vLLM with ids
        ({"choices": [{"text": "x", "token_ids": [], "finish_reason": "length"}]}, 0),  # qkvlab's finish chunk
        ({"choices": [{"text": "x", "finish_reason": None}]}, 1),  # llama.cpp, vLLM
        ({"choices": [{"text": "", "finish_reason": None}]}, 1),  # a special token's empty text (vLLM counts it)
        ({"choices": [{"text": "", "finish_reason": "stop"}]}, 0),  # finish only
        ({"choices": [{"text": "y", "finish_reason": "stop"}]}, 1),  # the last token with the finish
        ({"choices": [], "usage": {"completion_tokens": 3}}, 0),  # include_usage's last chunk
    ],
)
def test_chunk_tokens(chunk, tokens):
    assert sl.chunk_tokens(chunk) == tokens


def test_run_metrics_pool_itl_and_count_goodput():
    records = [
        record(0.0, [(0.5, 1), (0.7, 1), (1.0, 1)], usage_tokens=3),  # TTFT 0.5, TPOT 0.25, E2EL 1.0
        record(0.2, [(0.4, 1), (1.0, 4)], usage_tokens=5),  # TTFT 0.2, TPOT 0.15, E2EL 0.8
        record(0.3, [(0.6, 1)], usage_tokens=1),  # one token: TPOT None (0 for goodput)
        record(0.4, [], error="HTTP 400: too long"),
    ]
    m = sl.run_metrics(records, 2.0, {"ttft": 0.4, "tpot": 0.2})
    assert m["completed"] == 3 and m["failed"] == 1 and m["output_tokens"] == 9
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5
    assert m["good_requests"] == 2 and m["request_goodput"] == 1.0  # the second and the third
    assert m["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2 + 0.3) / 3)
    assert m["tpot_s"]["mean"] == pytest.approx(0.2) and m["tpot_s"]["p50"] == pytest.approx(0.2)
    assert m["itl_s"]["mean"] == pytest.approx((0.2 + 0.3 + 0.6) / 3)  # pooled: 0.2, 0.3 and 0.6
    assert m["e2el_s"]["p50"] == pytest.approx(0.8)
    assert sl.run_metrics(records, 2.0, {"e2el": 0.5})["good_requests"] == 1  # only the one-token request
    assert sl.run_metrics(records, 2.0, {})["request_goodput"] is None  # no SLO, no goodput


def test_slo_and_rates_parse():
    assert sl.parse_slo("ttft=2.0,tpot=0.2,e2el=30") == {"ttft": 2.0, "tpot": 0.2, "e2el": 30.0}
    assert sl.parse_slo("none") == {}
    assert sl.slo_text({"ttft": 2.0, "tpot": 0.2}) == "TTFT ≤ 2 s, TPOT ≤ 0.2 s"
    assert sl.parse_rates("1,2,4,inf") == (1.0, 2.0, 4.0, math.inf)
    for bad in ("itl=1", "ttft=-1", "ttft"):
        with pytest.raises(argparse.ArgumentTypeError):
            sl.parse_slo(bad)
    for bad in ("0,1", "x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            sl.parse_rates(bad)


# ---- the workload -------------------------------------------------------------------------------
def test_lengths_fixed_and_capped_lognormal():
    assert sl.parse_lengths("64") == sl.Lengths(64, 0.0, 64, 64)
    dist = sl.parse_lengths("median=40,sigma=1.0,min=4,max=300")
    drawn = sl.draw_lengths(dist, 4001, np.random.default_rng(0))
    assert drawn == sl.draw_lengths(dist, 4001, np.random.default_rng(0))  # seeded
    assert min(drawn) >= 4 and max(drawn) <= 300 and 4 in drawn and 300 in drawn  # clipped both ends
    assert 36 <= np.median(drawn) <= 44  # the lognormal's median
    summary = sl.length_summary(drawn)
    assert summary["p50"] == np.median(drawn) and summary["mean"] == pytest.approx(np.mean(drawn))
    for bad in ("median=0", "sigma=1", "median=10,min=20", "median=10,foo=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            sl.parse_lengths(bad)


def test_arrivals_poisson_or_all_at_once():
    assert sl.arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    offsets = sl.arrival_offsets(20_000, 4.0, random.Random(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps > 0).all()
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)  # mean gap 1 / rate


def test_only_loopback_endpoints():
    assert sl.loopback_root("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"
    for bad in (
        "http://localhost:8080/v1",
        "http://10.0.0.1:8080/v1",
        "https://127.0.0.1:8080/v1",
        "http://127.0.0.1/v1",
    ):
        with pytest.raises(UserError, match="127.0.0.1"):
            sl.loopback_root(bad)


# ---- end to end on a tiny random model ------------------------------------------------------------
SMALL = ["--prompt-len", "median=6,sigma=0.5,min=2,max=12", "--new-tokens", "median=4,sigma=0.5,min=2,max=8"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("serve_load") / "tiny"
    model = tiny_model("Q-K=V", "rope", None, dtype=torch.float32)
    save_model(folder, model, model.cfg)
    return folder


def check_outputs(out: Path, labels: list[str], rates: list[str], requests: int) -> dict:
    """Every request done with its drawn length; the figures re-derive from the raw timings."""
    result = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert [(r["label"], r["rate"]) for r in result["rows"]] == [(x, y) for x in labels for y in rates]
    for row in result["rows"]:
        assert row["completed"] == row["requests_sent"] == requests and row["failed"] == 0
        for req in row["requests"]:
            assert req["usage"]["completion_tokens"] == req["max_tokens"] == sum(req["chunk_tokens"])  # ignore_eos
            assert abs(req["usage"]["prompt_tokens"] - req["prompt_tokens_drawn"]) <= sl.TEXT_MARGIN
        raw = [
            {
                "sent": q["sent_s"],
                "chunks": list(zip(q["chunk_s"], q["chunk_tokens"])),
                "usage": q["usage"],
                "error": None,
            }
            for q in row["requests"]
        ]
        again = sl.run_metrics(raw, row["duration_s"], result["slo_s"])
        for name in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
            assert again[name] == pytest.approx(row[name])
        assert again["request_goodput"] == pytest.approx(row["request_goodput"])
    assert "TTFT ≤ 2 s, TPOT ≤ 0.2 s" in md and "realised mean" in md
    assert ("not measured quiet" in md) is (not result["measured_quiet"])
    assert (out / "serve_load.png").stat().st_size > 0
    return result


def test_endpoint_someone_else_started_with_text_prompts(tiny_dir, tmp_path):
    with Running(tiny_dir) as server:  # in this process, on a free 127.0.0.1 port: the script starts nothing
        argv = ["--out", str(tmp_path / "out"), "--endpoint", server.url + "/v1", "--rates", "50,inf"]
        argv += ["--requests", "4", "--time-limit", "30", *SMALL]
        assert sl.main(argv) == 0
    result = check_outputs(tmp_path / "out", ["tiny"], ["50", "inf"], 4)
    assert result["rows"][0]["model"] == "tiny" and result["cache_bytes"] is None
    assert result["workload"]["prompts"].startswith("text: slices of the packaged Shakespeare")
    assert "others' CPU includes the server" in result["load_text"]


def test_serve_starts_qkvlab_serve_at_one_cache_memory(tiny_dir, tmp_path):
    argv = ["--out", str(tmp_path / "out"), "--serve", f"kv={tiny_dir}", "--cache-memory", "40KB", "--dtype", "fp32"]
    argv += ["--block-size", "16", "--tokenizer", "bytes", "--rates", "inf", "--requests", "3", "--time-limit", "30"]
    argv += ["--server-threads", "1"]
    assert sl.main([*argv, *SMALL]) == 0
    result = check_outputs(tmp_path / "out", ["kv"], ["inf"], 3)
    row = result["rows"][0]
    assert result["cache_bytes"] == 40_000 and row["capacity_sequences"] == 3  # as test_serve's 40KB server
    assert row["peak_sequences"] >= 1


def test_refusals(tiny_dir, tmp_path):
    with pytest.raises(SystemExit):  # --serve without one cache memory
        sl.parse_args(["--out", str(tmp_path), "--serve", f"kv={tiny_dir}"])
    with pytest.raises(SystemExit):  # the longest request cannot fit --max-model-len
        sl.parse_args(
            ["--out", str(tmp_path), "--serve", f"kv={tiny_dir}", "--cache-memory", "1MB", "--max-model-len", "16"]
        )
    with pytest.raises(UserError, match="127.0.0.1"):
        sl.main(["--out", str(tmp_path / "o"), "--endpoint", "http://example.com:80/v1"])


def test_the_engine_benchmark_dry_runs_on_a_tiny_shape(capsys):
    """benchmarks/serve_engine.py --tiny: every figure printed (correctness of the run only, no speed)."""
    spec = importlib.util.spec_from_file_location("serve_engine", ROOT / "benchmarks" / "serve_engine.py")
    se = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(se)
    assert se.main(["--tiny", "--streams", "2", "--decoders", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("paged vs contiguous", "cached prefix vs first", "admitting vs not", "/health while"):
        assert needle in out
