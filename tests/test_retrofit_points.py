"""docs/results/retrofit/points.py: the committed points.csv is what the committed files give, and an MLA run
committed as mla/NAME/ (shaped as `qkvlab retrofit` writes it) joins on a rerun."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from qkvlab.base.errors import UserError
from qkvlab.retrofit.options import RetrofitOptions

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "retrofit"
_spec = importlib.util.spec_from_file_location("retrofit_points", RESULTS / "points.py")
points = sys.modules["retrofit_points"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(points)

HELD_OUT_ORIGINAL = 42.98273715153001  # smollm2_kv30_mix/curves.json's original, as a run of that model reports it


@pytest.fixture(scope="module")
def committed() -> list:
    return points.collect(RESULTS)


def test_committed_csv_is_what_the_files_give(committed):
    assert (RESULTS / "points.csv").read_text() == points.csv_text(committed)


def ratios(rows, route: str, cache: float, tokens: int, source: str) -> dict[str, float]:
    mine = [p for p in rows if (p.route, p.cache_fraction, p.distill_tokens) == (route, cache, tokens)]
    return {p.text: p.ratio for p in mine if source in p.source.split("; ")}


def printed(**ratios: float) -> dict:
    """The README's ratios to 3 decimals; some were divided from perplexities rounded to 2 first."""
    return {text.replace("_", "-"): pytest.approx(r, abs=6e-4) for text, r in ratios.items()}


def test_the_readme_figures_come_out(committed):
    """A few of the README's printed ratios, each from another kind of file, recomputed from the rows."""
    assert ratios(committed, "latent", 0.5, 307200, "smollm2_latent192/scores.json") == printed(
        shakespeare=0.983, moby_dick=1.012, sotu_2000=1.005
    )
    assert ratios(committed, "K=V", 0.5, 1536000, "smollm2_kv30_rest/scores.json") == printed(
        shakespeare=1.016, moby_dick=1.301, sotu_2000=1.173
    )
    assert ratios(committed, "latent", 0.25, 0, "smollm2_latent/closed_form.json") == printed(
        shakespeare=1.523, moby_dick=1.561, sotu_2000=1.837
    )
    assert ratios(committed, "MQA", 0.4888888888888889, 0, "smollm2_mqa30_mix/curves.json") == printed(
        shakespeare=1.478, moby_dick=2.0, sotu_2000=2.819
    )
    assert ratios(committed, "K=V", 0.9333333333333333, 0, "smollm2_fit_sweep.json") == printed(shakespeare=1.248)
    rest = next(p for p in committed if p.source.startswith("smollm2_kv15_rest/retrofit.json"))
    assert (rest.wall_s, rest.load, rest.distill_tokens) == (6318.2, "not quiet", 1228800)
    fit = next(p for p in committed if p.source.startswith("smollm2_kvmqa18_fit/retrofit.json"))
    assert (fit.route, fit.distill_tokens, fit.wall_s, fit.load) == ("K=V+MQA", 0, None, "")
    assert ratios(committed, "MLA", 0.5, 307200, "mla/mla50/steps.json") == printed(moby_dick=1.035, sotu_2000=1.033)
    assert ratios(committed, "MLA", 0.5, 0, "mla/mla50/steps.json") == printed(moby_dick=1.066, sotu_2000=1.091)
    mla = next(p for p in committed if p.source == "mla/mla50/steps.json" and p.distill_tokens)
    assert (mla.wall_s, mla.load, mla.ratio_hi) == (1813.0, "not quiet", pytest.approx(1.0493, abs=1e-4))
    assert {p.route for p in committed} == {"K=V", "MQA", "K=V+MQA", "latent", "MLA"}
    keys = [(p.route, p.cache_fraction, p.distill_tokens, p.text, p.ppl, p.ppl_original) for p in committed]
    assert len(keys) == len(set(keys))  # a fit copied into several folders is one row


def mla_report(ppl_original: float = HELD_OUT_ORIGINAL) -> dict:
    """A report with the keys workflow._report writes, for an MLA run at half the cache, distilled."""
    opts = RetrofitOptions(to="Q-K-V", kv_latent=160, rope_dim=32, steps=300, lr=1e-4, rest_lr=0.0)
    return {
        "source": "/work/smol", "original_scheme": "Q-K-V", "scheme": "Q-K-V (kv_latent=160, rope_dim=32)",
        "converted_layers": list(range(30)), "layers": [], "options": asdict(opts),
        "heldout_tokens_evaluated": 8192, "heldout_windows": 32, "calibration_tokens": 8192,
        "params_before": 134515008, "params_after": 130000000,
        "kv_cache_bytes_per_token_before": 23040, "kv_cache_bytes_per_token_after": 11520, "cache_ratio": 0.5,
        "ppl_original": ppl_original, "ppl_fit": ppl_original * 1.1, "ppl_uptrained": ppl_original * 1.02,
        "ratio_fit": [1.1, 1.08, 1.12], "ratio_uptrained": [1.02, 1.01, 1.03],
        "uptraining": {"steps": 300, "tokens": 307200, "last": {"step": 300, "elapsed_s": 2500.04}},
    }  # fmt: skip


def results_copy(tmp_path: Path, report: dict, scores: list[dict]) -> Path:
    """The committed results (data files and README) with an MLA run folder beside them."""
    root = tmp_path / "retrofit"
    shutil.copytree(RESULTS, root, ignore=shutil.ignore_patterns("*.png", "*.log", "*.py", "points.csv"))
    run = root / "mla" / "test50"
    run.mkdir(parents=True)
    (run / "retrofit.json").write_text(json.dumps(report))
    (run / "scores.json").write_text(json.dumps({"source": "/work/smol", "run": "mla50", "rows": scores}))
    return root


def score_row(report: dict, layers: int = 30, **texts: float) -> dict:
    return {"layers_converted": layers, "layers": list(range(layers)), "cache_fraction": report["cache_ratio"],
            "heldout": report["ppl_uptrained"], **texts}  # fmt: skip


def test_an_mla_run_joins(tmp_path, committed, monkeypatch):
    report = mla_report()
    root = results_copy(tmp_path, report, [score_row(report, **{"moby-dick": 66.0, "sotu-2000": 28.0})])
    with open(root / "README.md", "a") as f:
        f.write("\nThe MLA run, 50%: fit and distillation quiet, nothing beside it.\n")
    monkeypatch.setitem(points.LOAD_SAYS, "mla/test50", "fit and distillation quiet, nothing beside it")
    rows = points.collect(root)
    mla = [p for p in rows if p.source.startswith("mla/test50")]
    assert [p for p in rows if not p.source.startswith("mla/test50")] == committed  # the rows before it do not move
    by = {(p.distill_tokens, p.text): p for p in mla}
    assert sorted(by) == [(0, "shakespeare"), (307200, "moby-dick"), (307200, "shakespeare"), (307200, "sotu-2000")]
    fit, up = by[0, "shakespeare"], by[307200, "shakespeare"]
    assert (fit.ratio_lo, fit.ratio_hi, fit.wall_s, fit.load) == (1.08, 1.12, None, "")
    assert fit.ratio == pytest.approx(1.1, rel=1e-12) and fit.cache_fraction == 0.5
    assert (up.ratio_lo, up.ratio_hi, up.wall_s, up.load) == (1.01, 1.03, 2500.0, "quiet")
    assert up.source == "mla/test50/retrofit.json; mla/test50/scores.json"
    moby = by[307200, "moby-dick"]
    assert moby.ppl_original == 64.07681375882211 and moby.ppl == 66.0  # smollm2_kv30_mix/curves.json's original
    assert (moby.wall_s, moby.load, moby.ratio_lo) == (2500.0, "quiet", None)
    assert points.csv_text(rows).splitlines()[0] == ",".join(points.COLUMNS)
    points.draw(rows, tmp_path / "points.png")
    assert (tmp_path / "points.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_another_source_model_is_refused_unless_it_scores_its_original(tmp_path):
    report = mla_report(ppl_original=HELD_OUT_ORIGINAL * 1.05)
    root = results_copy(tmp_path, report, [score_row(report, **{"moby-dick": 66.0})])
    with pytest.raises(UserError, match=r"mla/test50: the original scores 45\.13 .* another source model"):
        points.collect(root)
    own = score_row(report, layers=0, **{"moby-dick": 60.0})
    (root / "mla" / "test50" / "scores.json").write_text(
        json.dumps({"rows": [own, score_row(report, **{"moby-dick": 66.0})]})
    )
    moby = next(p for p in points.collect(root) if p.source.startswith("mla/test50") and p.text == "moby-dick")
    assert (moby.ppl, moby.ppl_original) == (66.0, 60.0)


def test_a_text_under_another_name_is_refused(tmp_path):
    report = mla_report()
    root = results_copy(tmp_path, report, [score_row(report, sotu=28.0)])
    with pytest.raises(UserError, match=r"mla/test50/scores.json: a row scores \['sotu'\]; the texts are named"):
        points.collect(root)


def test_a_readme_quote_gone_is_named(tmp_path):
    root = results_copy(tmp_path, mla_report(), [])
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("43:30 wall, not quiet", "43:30 wall"))
    with pytest.raises(UserError, match="README.md no longer says '43:30 wall, not quiet' .*smollm2_kvmqa18_mix"):
        points.collect(root)
