"""benchmarks/decode_smollm2.py's llama.cpp binaries (--llama-bin): their commands, their outputs read
back (samples captured from llama-bench and llama-batched-bench of llama-cpp-python 0.3.36's vendored
llama.cpp on a tiny F32 GGUF), one timed turn through stand-in binaries that print those samples, and
the bandwidth limit with llama.cpp's cache entry size. Needs neither llama.cpp nor SmolLM2."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("decode_smollm2", ROOT / "benchmarks" / "decode_smollm2.py")
ds = sys.modules["decode_smollm2"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)

# llama-bench -m tiny.gguf -p 0 -n 7 -d 20 -r 1 -t 1 -ctk f16 -ctv f16 -o json (fields trimmed; stderr apart)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "model_type": "llama ?B all F32",
    "n_threads": 1,
    "type_k": "f16",
    "n_prompt": 0,
    "n_gen": 7,
    "n_depth": 20,
    "test_time": "2026-12-03T10:52:11Z",
    "avg_ns": 5106480,
    "stddev_ns": 0,
    "avg_ts": 1370.807288,
    "stddev_ts": 0.000000,
    "samples_ns": [ 5106480 ],
    "samples_ts": [ 1370.81 ]
  }
]
"""

# llama-batched-bench -m tiny.gguf -c 108 -npp 20 -ntg 7 -npl 1,4 -t 1 -ctk f32 -ctv f32 --output-format jsonl
BATCHED_JSONL = """
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1, "pp": 20, "tg": 7, "pl": 1, "n_kv": 27, "t_pp": 0.001146, "speed_pp": 17452.007812, "t_tg": 0.003843, "speed_tg": 1821.493652, "t": 0.004989, "speed": 5411.906250}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1, "pp": 20, "tg": 7, "pl": 4, "n_kv": 108, "t_pp": 0.001919, "speed_pp": 41688.378906, "t_tg": 0.003957, "speed_tg": 7076.067383, "t": 0.005876, "speed": 18379.849609}

llama_perf_context_print:        load time =      10.52 ms
"""

# the same without --output-format (its default md table)
BATCHED_MD = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    20 |      7 |    1 |     27 |    0.001 | 19083.97 |    0.004 |  1807.85 |    0.005 |  5487.81 |
|    20 |      7 |    4 |    108 |    0.002 | 46403.71 |    0.004 |  6376.68 |    0.006 | 17661.49 |

"""


def test_llama_bench_json_gives_seconds_per_decoded_token():
    assert ds.parse_llama_bench(LLAMA_BENCH_JSON, 7, 20) == pytest.approx(5106480e-9 / 7)
    with pytest.raises(ValueError, match="n_gen 8, n_depth 20"):
        ds.parse_llama_bench(LLAMA_BENCH_JSON, 8, 20)
    with pytest.raises(ValueError, match="no test"):
        ds.parse_llama_bench("", 7, 20)
    older = LLAMA_BENCH_JSON.replace('    "n_depth": 20,\n', "")  # a build before -d: no n_depth, depth 0
    assert ds.parse_llama_bench(older, 7, 0) == pytest.approx(5106480e-9 / 7)


def test_batched_bench_jsonl_and_its_table_read_the_same_rows():
    rows = ds.parse_batched_bench(BATCHED_JSONL)
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(20, 7, 1), (20, 7, 4)]
    assert rows[1]["t_pp"] == 0.001919 and rows[1]["t_tg"] == 0.003957
    table = ds.parse_batched_bench(BATCHED_MD)
    assert [(r["pp"], r["tg"], r["pl"]) for r in table] == [(20, 7, 1), (20, 7, 4)]
    assert all(isinstance(r["pl"], int) for r in table)
    assert table[1]["t_pp"] == 0.002 and table[1]["t_tg"] == 0.004 and table[1]["S_TG t/s"] == 6376.68
    assert ds.parse_batched_bench("no results\n| a | b |\n") == []


def test_commands_ask_for_the_scripts_setting():
    cmd = ds.llama_bench_command(Path("bin/llama-bench"), Path("m.gguf"), 200, 63, 2, "f16")
    assert cmd[:3] == ["bin/llama-bench", "-m", "m.gguf"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {
        "-p": "0",
        "-n": "63",
        "-d": "200",
        "-r": "1",
        "-t": "2",
        "-ctk": "f16",
        "-ctv": "f16",
        "-fa": "off",  # on: llama.cpp would cast the cache to f16 before every attention
        "-o": "json",
    }
    cmd = ds.batched_bench_command(Path("llama-batched-bench"), Path("m.gguf"), 200, 63, 16, 2, "f32")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-c"] == str(16 * 263)  # every stream fits: a smaller context makes it skip the test silently
    assert (flags["-npp"], flags["-ntg"], flags["-npl"], flags["-t"], flags["-tb"]) == ("200", "63", "16", "2", "2")
    assert (flags["-ctk"], flags["-ctv"], flags["-fa"], flags["--output-format"]) == ("f32", "f32", "off", "jsonl")
    cmd = ds.batched_bench_command(Path("b"), Path("m.gguf"), 200, 63, 16, 2, "f16", "auto")  # llama.cpp's default
    assert cmd[cmd.index("-fa") + 1] == "auto"


def stand_ins(folder: Path, bench_out: str, batched_out: str) -> Path:
    """Executables named llama-bench and llama-batched-bench that print a captured output and log their argv."""
    folder.mkdir()
    for name, out in (("llama-bench", bench_out), ("llama-batched-bench", batched_out)):
        (folder / f"{name}.out").write_text(out)
        script = folder / name
        script.write_text(
            f'#!/bin/sh\necho "$@" > "{folder}/{name}.args"\necho loading >&2\ncat "{folder}/{name}.out"\n'
        )
        script.chmod(0o755)
    return folder


def test_llama_bin_times_a_turn_of_each_binary(tmp_path):
    folder = stand_ins(tmp_path / "bin", LLAMA_BENCH_JSON.replace('"n_depth": 20', '"n_depth": 16'), BATCHED_JSONL)
    bins = ds.LlamaBin(folder, tmp_path / "m.gguf", 1, "f32")
    assert bins.names(1) == ["llama-batched-bench f32", "llama-bench f32"] and bins.names(4) == [
        "llama-batched-bench f32"
    ]
    assert (
        bins.cache("llama-bench f32") == "f16" and bins.cache("llama-batched-bench f32") == "f32"
    )  # no f32 in llama-bench
    prefill, step = bins.time("llama-bench f32", 1, 16, 8)  # 8 new tokens: 7 timed steps, as qkvlab times them
    assert math.isnan(prefill) and step == pytest.approx(5106480e-9 / 7)
    assert "-n 7 -d 16" in (folder / "llama-bench.args").read_text()
    with pytest.raises(SystemExit, match="no row for pp 16"):  # the sample was taken at pp 20
        bins.time("llama-batched-bench f32", 4, 16, 8)
    assert bins.time("llama-batched-bench f32", 4, 20, 8) == (0.001919, pytest.approx(0.003957 / 7))
    assert "-npl 4" in (folder / "llama-batched-bench.args").read_text()


def test_llama_bin_refusals(tmp_path):
    with pytest.raises(SystemExit, match="no llama-bench, llama-batched-bench there"):
        ds.LlamaBin(tmp_path, tmp_path / "m.gguf", 1, "f32")
    folder = stand_ins(tmp_path / "bin", "", "")
    (folder / "llama-bench").write_text("#!/bin/sh\necho 'error: invalid parameter for argument: -ctk' >&2\nexit 1\n")
    with pytest.raises(SystemExit, match="llama-bench exited 1: error: invalid parameter"):
        ds.LlamaBin(folder, tmp_path / "m.gguf", 1, "f32").time("llama-bench f32", 1, 16, 8)


def test_limit_counts_llama_cpp_cache_entries():
    cfg = ModelConfig(n_layer=2, n_head=4, kv_heads=2, d_model=32, vocab_size=256, context=64, pos="rope").validate()
    model = GPT(cfg)
    full = ds.limit_tokens_per_s(model, 16, 100.0, 1e9)
    half = ds.limit_tokens_per_s(model, 16, 100.0, 1e9, cache_scale=0.5)
    weights, cache = ds.weight_bytes_per_step(model), ds.cache_bytes_per_token(model)
    assert full == pytest.approx(16e9 / (weights + 1600 * cache))
    assert half == pytest.approx(16e9 / (weights + 800 * cache)) and half > full


def test_a_gguf_s_weight_type_and_bytes_name_llama_cpp_s_rows_and_set_its_limit(tmp_path):
    """A BF16/F16 GGUF (llama-quantize's) is its own contestant: rows named by its weight type, the
    bandwidth limit reading its tensors' bytes rather than the fp32 model's."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float16))  # 8192 bytes
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))  # 256 bytes
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert ds.gguf_weights(path) == ("f16", 8192 + 256)
    folder = stand_ins(tmp_path / "bin", LLAMA_BENCH_JSON, BATCHED_JSONL)
    bins = ds.LlamaBin(folder, path, 1, "f16", weights=ds.gguf_weights(path))
    assert bins.names(1) == ["llama-batched-bench f16", "llama-bench f16"]
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, context=16).validate())
    own = ds.limit_tokens_per_s(model, 1, 0.0, 1e9)
    assert ds.limit_tokens_per_s(model, 1, 0.0, 1e9, weight_bytes=bins.weight_bytes) == pytest.approx(1e9 / 8448)
    assert own != pytest.approx(1e9 / 8448)


def test_each_gguf_is_a_contestant_with_its_cache_in_its_weight_type(tmp_path):
    """--llama-gguf F32 BF16: two llama.cpp contestants in the same rounds, each KV cache in its weights'
    type unless --llama-cache-type fixes one; two files of one type are refused."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")

    def write(name, dtype, ggml_type=None):
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=dtype), raw_dtype=ggml_type)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return path

    f32, f16 = write("f32.gguf", np.float32), write("f16.gguf", np.float16)
    folder = stand_ins(tmp_path / "bin", LLAMA_BENCH_JSON, BATCHED_JSONL)
    bins = ds.llama_bins(folder, [f32, f16], 2, ds.WEIGHTS_CACHE, "off")
    assert [x.weight_type for x in bins] == ["f32", "f16"]
    assert [x.cache(f"llama-batched-bench {x.weight_type}") for x in bins] == ["f32", "f16"]
    assert [x.cache(f"llama-bench {x.weight_type}") for x in bins] == ["f16", "f16"]  # llama-bench has no f32
    assert [n for x in bins for n in x.names(1)] == [
        "llama-batched-bench f32",
        "llama-bench f32",
        "llama-batched-bench f16",
        "llama-bench f16",
    ]
    fixed = ds.llama_bins(folder, [f32, f16], 2, "bf16", "off")
    assert {x.cache(f"llama-batched-bench {x.weight_type}") for x in fixed} == {"bf16"}
    with pytest.raises(SystemExit, match="holds F32 weights as an earlier file does"):
        ds.llama_bins(folder, [f32, write("again.gguf", np.float32)], 2, ds.WEIGHTS_CACHE, "off")
