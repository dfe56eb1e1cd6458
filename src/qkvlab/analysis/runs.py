"""A compare folder on disk: ``compare.json`` (the plan: tasks, variants, seeds, run folders,
timing, machine) and one run folder per (task, variant, seed), each written by the train loop
(``metrics.jsonl``, ``config.json`` whose ``train.finished`` is true, ``model.safetensors``) and,
once scored on the held-out test split, ``test.json``: {"split": "test", "metric": NAME, NAME: value,
other metrics, "n": scored units, "se": the evaluation's standard error of NAME (SD over units /
sqrt(n)), "units": what a unit is (windows, lists, images, sets)}.
"""

from __future__ import annotations

import json
import lzma
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, json_text
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import read_config, read_metrics

MANIFEST = "compare.json"
SCORES = "scores.json"  # every run's scores, curves and model config: what --render re-derives results from
# the same, compressed (a committed copy of many per-unit scores); read when scores.json is not there
SCORES_XZ = SCORES + ".xz"
LR_SCAN_FILE = "lr_scan.json"  # an lr scan's choice per shape, beside a sweep's results (compare/sweep.py)
UNIT_DIGITS = 6  # per-unit scores are kept to 1e-6 (a loss of ~4 nats: 7 significant digits)

# ---- runs -------------------------------------------------------------------------------------
METRICS, CONFIG, WEIGHTS, TEST = "metrics.jsonl", "config.json", "model.safetensors", "test.json"


def run_finished(run_dir: str | Path) -> bool:
    """A run is finished when its final model and metrics exist (config.json says finished)."""
    d = Path(run_dir)
    if not ((d / WEIGHTS).is_file() and (d / METRICS).is_file() and (d / CONFIG).is_file()):
        return False

    try:
        _, body = read_config(d)
    except UserError:
        return False
    train = body.get("train") if isinstance(body.get("train"), dict) else {}
    return bool(body.get("finished") or train.get("finished"))


@dataclass
class Run:
    task: str
    variant: str
    seed: int
    dir: Path
    cfg: ModelConfig
    history: list[dict[str, Any]]
    point: str = ""  # grid point label; with the seed, what pairs runs across variants
    test: dict[str, Any] | None = None  # test.json: the run scored on the test split (None: not scored)

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]

    @property
    def tokens_per_s(self) -> float | None:
        vals = [r["tokens_per_s"] for r in self.history if r.get("step", 0) > 0 and r.get("tokens_per_s")]
        return sum(vals) / len(vals) if vals else None

    def curve(self, key: str = "val_loss") -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]


def read_test(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's test.json (None when absent); a file that is not a JSON object is an error."""
    path = Path(run_dir) / TEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(body, dict):
        raise UserError(f"{path}: expected a JSON object with the test split's metrics")
    return body


def test_value(test: dict[str, Any] | None, metric: str) -> tuple[float, float, int, tuple | None] | None:
    """(value, se, units, per-unit values) of a validation metric's counterpart in test.json: the
    same key, or the key without "val_" (val_loss -> loss); se and per-unit values only when
    test.json's own metric is that key (they describe that metric alone). None when test.json
    lacks it."""
    if not test:
        return None
    key = metric if test.get(metric) is not None else metric.removeprefix("val_")
    if test.get(key) is None:
        return None
    own = test.get("metric") == key
    se = float(test.get("se") or 0.0) if own else 0.0
    per_unit = tuple(test["per_unit"]) if own and test.get("per_unit") else None
    return float(test[key]), se, int(test.get("n") or 0), per_unit


def load_run(task: str, variant: str, seed: int, run_dir: str | Path, point: str = "") -> Run:
    cfg, _ = read_config(run_dir)
    history = read_metrics(run_dir, required=True)
    return Run(task, variant, seed, Path(run_dir), cfg, history, point, read_test(run_dir))


# ---- manifest ---------------------------------------------------------------------------------
def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path}: no such file (a compare folder is written by `qkvlab compare`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg})") from None


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(out_dir) / MANIFEST, json_text(manifest, indent=2))


# ---- stored scores ----------------------------------------------------------------------------
def _compact_test(test: dict[str, Any] | None) -> dict[str, Any] | None:
    if not test:
        return test
    out = dict(test)
    if out.get("per_unit"):
        out["per_unit"] = [round(float(x), UNIT_DIGITS) for x in out["per_unit"]]
    return out


def scores_body(runs: list[Run], manifest: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """scores.json: per run its evaluation history (metrics.jsonl), its test split's scores with
    every unit's score (test.json, per-unit values rounded to 1e-6) and its model config: all
    results.md reads, so the folder's verdicts can be re-derived without the run folders."""
    return {
        "format": "qkvlab scores 1",
        "analysis_version": manifest.get("analysis_version"),
        "runs": [
            {
                "task": r.task,
                "variant": r.variant,
                "seed": r.seed,
                "point": r.point,
                "dir": os.path.relpath(r.dir, out_dir),
                "model": r.cfg.to_dict(),
                "history": r.history,
                "test": _compact_test(r.test),
            }
            for r in runs
        ],
    }


def write_scores(out_dir: str | Path, runs: list[Run], manifest: dict[str, Any]) -> None:
    """One run per line, so a diff of two scorings reads run by run."""
    body = scores_body(runs, manifest, out_dir)
    lines = [json.dumps(r, sort_keys=True) for r in body["runs"]]
    head = json.dumps({k: v for k, v in body.items() if k != "runs"}, sort_keys=True)[:-1]
    atomic_write(Path(out_dir) / SCORES, head + ', "runs": [\n' + ",\n".join(lines) + "\n]}\n")


def read_scores(out_dir: str | Path) -> list[Run] | None:
    """The runs stored in OUT/scores.json, else OUT/scores.json.xz (None when there is neither); a
    malformed file is an error."""
    path = Path(out_dir) / SCORES
    if not path.is_file():
        path = path.with_name(SCORES_XZ)
        if not path.is_file():
            return None
    try:
        raw = lzma.decompress(path.read_bytes()) if path.name == SCORES_XZ else path.read_bytes()
        body = json.loads(raw)
        runs = [
            Run(
                r["task"],
                r["variant"],
                int(r["seed"]),
                Path(out_dir) / r["dir"],
                ModelConfig.from_dict(r["model"]),
                r["history"],
                r.get("point", ""),
                r.get("test"),
            )
            for r in body["runs"]
        ]
    except (json.JSONDecodeError, lzma.LZMAError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a scores file written by qkvlab compare ({type(e).__name__}: {e})") from None
    return runs
