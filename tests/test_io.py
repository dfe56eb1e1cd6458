"""qkvlab.model.folder: model folders loaded without a throwaway init, tied weights, the atomic writer, metrics."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_file, atomic_write, labelled_path
from qkvlab.model.config import preset
from qkvlab.model.folder import (
    METRICS,
    WEIGHTS,
    load_model,
    read_metrics,
    save_model,
    state_dict_for_save,
    tied_aliases,
)
from qkvlab.model.transformer import GPT

SCHEMES = [
    dict(attn="Q-K-V"),
    dict(attn="Id-K=V", pos="rope", kv_heads=1),
    dict(attn="(Q=K=V)+"),
    dict(attn="(Q-K=V)+", pos="rope", tie_embeddings=False, mlp="swiglu", norm="rmsnorm"),
    dict(attn="Q=K-V", pos="none", share_layers=True, bias=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("over", SCHEMES, ids=lambda o: o["attn"] + "/" + o.get("pos", "learned"))
def test_loaded_model_equals_saved_model_bit_for_bit(tmp_path, over, dtype):
    cfg = preset("tiny", **over)
    torch.manual_seed(1)
    model = GPT(cfg).to(dtype).eval()
    save_model(tmp_path / "m", model, cfg)
    rng = torch.get_rng_state()
    back, cfg2, _ = load_model(tmp_path / "m")
    assert torch.equal(torch.get_rng_state(), rng)  # nothing was drawn: no random init
    assert cfg2 == cfg
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    # the computed tables (rotary, 2D sinusoids) are rebuilt, in the weights' dtype, on no meta device
    bufs, bufs2 = dict(model.named_buffers()), dict(back.named_buffers())
    assert bufs.keys() == bufs2.keys() and all(torch.equal(bufs[k], bufs2[k]) for k in bufs)
    assert not any(t.is_meta for t in (*back.parameters(), *back.buffers()))
    assert (back.lm_head.weight is back.tok_emb.weight) == cfg.tie_embeddings
    assert len(list(back.parameters())) == len(list(model.parameters()))
    x = torch.randint(0, cfg.vocab_size, (2, 11))
    assert torch.equal(model(x)[0], back(x)[0])


def test_tied_weights_are_stored_once_and_retied(tmp_path):
    cfg = preset("tiny")
    model = GPT(cfg)
    assert tied_aliases(model) == {"lm_head.weight": "tok_emb.weight"}
    assert tied_aliases(GPT(preset("tiny", tie_embeddings=False))) == {}
    state = state_dict_for_save(model)
    assert "lm_head.weight" not in state and "tok_emb.weight" in state
    save_model(tmp_path / "m", model, cfg)
    back, _, _ = load_model(tmp_path / "m")
    back.tok_emb.weight.data[0, 0] = 123.0  # one tensor: the head sees it
    assert back.lm_head.weight[0, 0] == 123.0


def test_non_float_weights_and_wrong_shapes_are_refused(tmp_path):
    cfg = preset("tiny")
    save_model(tmp_path / "m", GPT(cfg), cfg)
    state = load_file(str(tmp_path / "m" / WEIGHTS))
    bad = dict(state, **{"trunk.norm.weight": torch.ones(cfg.d_model, dtype=torch.int64)})
    save_file(bad, str(tmp_path / "m" / WEIGHTS))
    with pytest.raises(UserError, match="trunk.norm.weight has dtype torch.int64"):
        load_model(tmp_path / "m")
    bad = dict(state, **{"trunk.norm.weight": torch.ones(cfg.d_model + 1)})
    save_file(bad, str(tmp_path / "m" / WEIGHTS))
    with pytest.raises(UserError, match=r"trunk.norm.weight has shape \(65,\)|shape"):
        load_model(tmp_path / "m")


def test_atomic_writer_publishes_whole_files_with_ordinary_modes(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.txt", "héllo\n")
        atomic_write(tmp_path / "b.bin", b"\x00\x01")
        save_model(tmp_path / "m", GPT(preset("tiny")), preset("tiny"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n" and (
        tmp_path / "b.bin"
    ).read_bytes() == b"\0\1"
    for f in (tmp_path / "a.txt", tmp_path / "b.bin", tmp_path / "m" / WEIGHTS, tmp_path / "m" / "config.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o755
    # a writer that fails leaves the old file and no temp file
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "a.txt") as f:
        f.write("partial")
        raise RuntimeError("disk full")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "m"]


def test_one_metrics_reader(tmp_path):
    assert read_metrics(tmp_path) == []
    with pytest.raises(UserError, match="no such file"):
        read_metrics(tmp_path, required=True)
    (tmp_path / METRICS).write_text(json.dumps({"step": 0}) + "\n\n" + json.dumps({"step": 5}) + "\n")
    assert read_metrics(tmp_path, required=True) == [{"step": 0}, {"step": 5}]
    (tmp_path / METRICS).write_text('{"step": 0}\n{"step": \n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)


def test_a_folder_named_as_a_text_file_is_called_a_folder(tmp_path):
    from qkvlab.base.files import read_user_text

    with pytest.raises(UserError, match="is a folder; give a file"):  # was "no such file"
        read_user_text(tmp_path, "--config")
    with pytest.raises(UserError, match="no such file"):
        read_user_text(tmp_path / "missing")


def test_labelled_path_splits_where_an_existing_path_follows(tmp_path):
    """Labels and folders may both hold '=' (K=V, lm/Q-K=V/seed0): the split is where the path exists."""
    run = tmp_path / "lm" / "Q-K=V" / "seed0"
    run.mkdir(parents=True)
    assert labelled_path(f"Q-K=V={run}") == ("Q-K=V", str(run))
    assert labelled_path(f"kv={run}") == ("kv", str(run))
    assert labelled_path(str(run)) == ("", str(run))  # an existing path alone is a path, '=' or not
    assert labelled_path(f"K=V 30 layers={tmp_path}/missing") == ("K=V 30 layers", f"{tmp_path}/missing")
    assert labelled_path("plain/folder") == ("", "plain/folder")
