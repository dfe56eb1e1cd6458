"""Finished runs -> one row per (task, variant): means and spreads over seeds, perplexity change
against Q-K-V paired by seed, parameter and KV-cache figures, the papers' values beside them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import Interval
from qkvlab.analysis.rules import CURRENT, Rules
from qkvlab.analysis.runs import Run, load_run, read_manifest, read_scores, run_finished, test_value
from qkvlab.analysis.trends import Trajectory, Trend, trajectories_from_runs
from qkvlab.analysis.verdicts import (
    PERPLEXITY_METRIC,
    ClaimVerdict,
    check_claims,
    gap_interval,
    score_sources,
    values_from_runs,
)
from qkvlab.model.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.model.variants import BASELINE

CACHE_DTYPE = "bf16"  # the papers' training dtype; the cache column's unit


# ---- aggregation ------------------------------------------------------------------------------
def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    n = len(xs)
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0)


@dataclass
class Row:
    """One (task, variant) line of the results."""

    task: str
    variant: str
    metric: str
    higher_is_better: bool
    seeds: list[int]
    planned: int
    cfg: ModelConfig
    metric_values: list[float]
    val_losses: list[float]
    tokens_per_s: float | None
    steps: int
    ppl_change: list[float] = field(default_factory=list)  # % vs Q-K-V, paired by seed, of the scored loss
    scored_on: str = "validation"  # what metric_values are: "test split" or "validation"

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def metric_mean_std(self) -> tuple[float, float]:
        return mean_std(self.metric_values)

    @property
    def val_loss_mean_std(self) -> tuple[float, float]:
        return mean_std(self.val_losses)

    @property
    def ppl_change_mean_std(self) -> tuple[float, float] | None:
        """Mean (exp of the mean log perplexity ratio, as the verdicts use) and sample std of the
        per-seed perplexity changes."""
        if not self.ppl_change:
            return None
        log_ratio = [math.log1p(p / 100.0) for p in self.ppl_change]
        return 100.0 * math.expm1(sum(log_ratio) / len(log_ratio)), mean_std(self.ppl_change)[1]

    @property
    def params(self):
        return analytic_params(self.cfg)

    @property
    def causal(self) -> bool:
        return self.cfg.causal

    @property
    def kv_bytes(self) -> int:
        return kv_cache_bytes_per_token(self.cfg, CACHE_DTYPE)

    @property
    def kv_fraction(self) -> float:
        base = self.cfg.replace(attn=BASELINE, kv_heads=None, kv_latent=None, rope_dim=None, match_params=None)
        return self.kv_bytes / kv_cache_bytes_per_token(base, CACHE_DTYPE)

    @property
    def paper_metric(self) -> float | None:
        return pf.task_metric(self.task, self.variant)

    @property
    def paper_ppl_change(self) -> pf.PaperValue | None:
        return pf.lm_ppl_change(self.variant) if self.task == "lm" else None

    @property
    def paper_kv_fraction(self) -> float | None:
        return pf.PAPER_B_LM_CACHE_FRACTION.get(self.variant) if self.task == "lm" else None


@dataclass
class Results:
    rows: list[Row]
    runs: list[Run]
    manifest: dict[str, Any]
    missing: list[tuple[str, str, int]]  # planned runs that have not finished
    rules: Rules = CURRENT  # the analysis rules the verdicts and intervals apply
    from_scores: bool = False  # read from scores.json (the run folders are not on disk)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r.task for r in self.rows))

    @property
    def variants(self) -> list[str]:
        return list(dict.fromkeys(r.variant for r in self.rows))

    def row(self, task: str, variant: str) -> Row | None:
        return next((r for r in self.rows if r.task == task and r.variant == variant), None)

    @property
    def metric(self) -> dict[str, str]:
        return {r.task: r.metric for r in self.rows}

    @property
    def higher_is_better(self) -> dict[str, bool]:
        return {r.task: r.higher_is_better for r in self.rows}

    def values(self) -> dict[str, dict[str, dict[Any, Any]]]:
        """task -> variant -> (grid point, seed) -> final score: what verdicts read (the test
        split's, with its se, when every run of the task has test.json; else validation)."""
        return values_from_runs(self.runs, self.metric)

    def sources(self) -> dict[str, str]:
        """task -> what was scored: 'test split, n=...' or 'validation'."""
        return score_sources(self.runs, self.metric)

    def verdicts(self) -> list[ClaimVerdict]:
        """One word per claim of the papers the tasks touch (None: not tested)."""
        return check_claims(self.values(), self.higher_is_better, self.metric, sources=self.sources(), rules=self.rules)

    def gaps(self) -> dict[tuple[str, str], Interval]:
        """(task, variant) -> its gap to Q-K-V with a paired 95% interval (perplexity change in %
        for lm, metric points for tasks)."""
        vals, out = self.values(), {}
        for task, by_variant in vals.items():
            base = by_variant.get(BASELINE)
            for variant, v in by_variant.items():
                if base is not None and variant != BASELINE:
                    iv = gap_interval(v, base, self.metric[task] == PERPLEXITY_METRIC, self.rules.eval_variance)
                    if iv is not None:
                        out[task, variant] = iv
        return out

    def trends(self) -> list[tuple[str, Trajectory, Trend]]:
        """(task, trajectory, trend) of every variant's gap to Q-K-V over training."""
        return trajectories_from_runs(self.runs, self.metric, BASELINE)


def _metric_of(run: Run) -> str:
    """The task's metric when the manifest does not declare it: the first non-standard number."""
    standard = {"step", "tokens", "train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "elapsed_s"}
    extra = [k for k in run.final if k not in standard and isinstance(run.final[k], (int, float))]
    return extra[0] if extra else "val_loss"


def _read_runs(out_dir: Path, manifest: dict) -> tuple[list[Run], list[tuple[str, str, int]], dict, bool]:
    """The manifest's finished runs, the planned ones not finished, runs planned per cell, and
    whether the runs came from scores.json (no run folder of the manifest on disk: a committed
    results folder)."""
    runs: list[Run] = []
    missing: list[tuple[str, str, int]] = []
    planned: dict[tuple[str, str], int] = {}
    for entry in manifest["runs"]:
        key = (entry["task"], entry["variant"])
        planned[key] = planned.get(key, 0) + 1
        run_dir = out_dir / entry["dir"]
        if run_finished(run_dir):
            runs.append(load_run(entry["task"], entry["variant"], int(entry["seed"]), run_dir, entry.get("point", "")))
        else:
            missing.append((entry["task"], entry["variant"], int(entry["seed"])))
    stored = read_scores(out_dir) if not runs else None
    if stored:
        have = {(r.task, r.variant, r.seed, r.point) for r in stored}
        missing = [m for m in missing if not any(h[:3] == m for h in have)]
        return stored, missing, planned, True
    return runs, missing, planned, False


def _task_metrics(runs: list[Run], manifest: dict) -> dict[str, tuple[str, bool]]:
    """task -> (metric, higher is better): declared by the manifest, else inferred from its runs."""
    out = {t: (v["metric"], v["higher_is_better"]) for t, v in manifest.get("metrics", {}).items()}
    for r in runs:
        if r.task not in out:
            metric = _metric_of(r)
            out[r.task] = (metric, metric != "val_loss")  # accuracies and IoUs go up
    return out


def _score(run: Run, key: str, on_test: bool) -> float:
    """The run's final key: its test split's when the task is scored on test (and test.json has
    it), else its last validation row's."""
    tv = test_value(run.test, key) if on_test else None
    return tv[0] if tv else float(run.final[key])


def collect(out_dir: str | Path, rules: Rules = CURRENT) -> Results:
    """Read a compare folder: every finished run of the manifest (or, with none on disk, the runs
    stored in its scores.json), aggregated per (task, variant), to be scored under `rules`. A task
    whose every run has test.json is scored on the test split, else on validation."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    runs, missing, planned, from_scores = _read_runs(out_dir, manifest)
    metrics = _task_metrics(runs, manifest)
    on_test = {t for t, (m, _) in metrics.items() if all(test_value(r.test, m) for r in runs if r.task == t)}
    rows: list[Row] = []
    for (task, variant), n_planned in planned.items():
        group = [r for r in runs if r.task == task and r.variant == variant]
        if not group:
            continue
        metric, hib = metrics[task]
        tps = [t for t in (r.tokens_per_s for r in group) if t is not None]
        rows.append(
            Row(
                task=task,
                variant=variant,
                metric=metric,
                higher_is_better=hib,
                seeds=[r.seed for r in group],
                planned=n_planned,
                cfg=group[0].cfg,
                metric_values=[_score(r, metric, task in on_test) for r in group],  # what verdicts read
                val_losses=[float(r.final["val_loss"]) for r in group],  # validation (curves, val_loss_* columns)
                tokens_per_s=sum(tps) / len(tps) if tps else None,
                steps=max(int(r.final["step"]) for r in group),
                scored_on="test split" if task in on_test else "validation",
            )
        )
    _pair_perplexities(rows)
    return Results(rows, runs, manifest, missing, rules, from_scores)


def _pair_perplexities(rows: list[Row]) -> None:
    """Perplexity change vs Q-K-V, paired by seed (same data order and initialisation: less noise)."""
    for row in rows:
        base = next((b for b in rows if b.task == row.task and b.variant == BASELINE), None)
        if base is None or row.metric != "val_loss":
            continue
        base_loss = dict(zip(base.seeds, base.metric_values))  # the scored loss (test split when there)
        row.ppl_change = [
            100.0 * math.expm1(loss - base_loss[s]) for s, loss in zip(row.seeds, row.metric_values) if s in base_loss
        ]
