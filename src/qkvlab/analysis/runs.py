"""A compare folder on disk: ``compare.json`` (the plan: tasks, variants, seeds, run folders,
timing, machine) and one run folder per (task, variant, seed), each written by the train loop
(``metrics.jsonl``, ``config.json`` whose ``train.finished`` is true, ``model.safetensors``) and,
once scored on the held-out test split, ``test.json``: {"split": "test", "metric": NAME, NAME: value,
other metrics, "n": scored units, "se": the evaluation's standard error of NAME (SD over units /
sqrt(n)), "units": what a unit is (windows, lists, images, sets)}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.io import atomic_write, json_text, read_config, read_metrics

MANIFEST = "compare.json"

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
