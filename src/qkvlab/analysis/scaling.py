"""Scaling analysis: each variant's gap to Q-K-V at every model size trained, and the slope of the
gap in log N, each with its interval. No prediction reaches more than MAX_EXTRAPOLATION x the
largest size trained: a line fitted over 1-2 decades of tiny models says nothing about 124M or 300M.

Runs are grouped by size (the folder above the variant: OUT/<size>/<variant slug>/seed<k>). A
size's N is the non-embedding parameter count of Q-K-V at that size's shape (qkvlab.model.accounting;
every variant at a size is compared at the same N, whatever its own count), D the training
tokens of its runs, compute C = 6 N D.

The gap of a variant at a size is the perplexity change vs Q-K-V, 100 (exp(mean d) - 1) % with d
the loss difference to Q-K-V of the same seed, and a paired 95% interval over the size's seeds
(:func:`qkvlab.analysis.verdicts.paired_estimate`: the spread of the per-seed d plus the
evaluation's own error when the runs were scored on the test split; one seed: the evaluation's
error alone, or no interval). The slope is the least-squares line d = a + b log10(N) through the
size means of d (analysis version 4; versions <= 3 fitted every per-seed d, counting seeds as if they
were sizes), with its 95% t-interval (df = sizes - 2); d is the log perplexity ratio, so it may be
negative or cross zero, which a power law on the gap cannot fit. A lack-of-fit F test (the line
through every per-seed point against the size means) says whether a line describes the sizes at
all; the word, as for the gap over training (``flat`` when the interval contains 0, ``shrinking``
when the gap moves toward 0 as N grows, ``growing`` otherwise), is given only where it does not
reject (else ``no line``). The same line is fitted against log10(C).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.estimates import Measured, paired_estimate
from qkvlab.analysis.intervals import LEVEL, Fit, Interval, LackOfFit, lack_of_fit, ols
from qkvlab.analysis.rules import CURRENT, Rules
from qkvlab.analysis.runs import UNIT_DIGITS, read_test, run_finished, test_value
from qkvlab.analysis.trends import FLAT, GROWING, SHRINKING
from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import preset
from qkvlab.model.folder import read_config, read_metrics
from qkvlab.model.spec import parse_scheme
from qkvlab.model.variants import BASELINE, Variant
from qkvlab.train.config import config_fingerprint

NO_LINE = "no line"  # the slope's word when a lack-of-fit test rejects the straight line

MAX_EXTRAPOLATION = 10.0  # no prediction beyond this multiple of the largest N trained
# The papers' model sizes: (label, qkvlab preset); N is its non-embedding count (accounting).
PAPER_SIZES = {"A": ("124M", "gpt2-124m"), "B": ("300M", "paperB-300m")}


def paper_size_params(paper: str) -> int:
    return analytic_params(preset(PAPER_SIZES[paper][1])).non_embedding


@dataclass(frozen=True)
class ScalingRun:
    """One finished run of a sweep, as plain data."""

    size: str  # size label (folder name)
    variant: str
    seed: int
    params: int  # the run's own non-embedding parameters
    params_total: int
    size_params: int  # N of the size: Q-K-V's non-embedding parameters at this shape
    tokens: int  # training tokens at the end
    val_loss: float  # the scored loss: the test split's when every run has test.json, else validation
    steps: int
    dir: str = ""
    train_s: float = 0.0  # training time of the run (its last row's elapsed_s)
    se: float = 0.0  # the evaluation's own standard error of val_loss (test split; 0: unknown)
    per_unit: tuple[float, ...] | None = None  # every test window's loss (test.json; scores.json beside the csv)
    config: str = ""  # the run's config_fingerprint (""; unknown): what lets a recorded row stand for a planned run

    @property
    def compute(self) -> float:
        """Training FLOPs 6 N D with the run's own non-embedding N."""
        return 6.0 * self.params * self.tokens


@dataclass
class VariantScaling:
    variant: str
    gaps: dict[str, Interval]  # size -> paired gap (% perplexity), 95%
    points: list[tuple[str, float]]  # (size, per-seed loss difference in nats) the fits use
    fit_params: Fit | None  # loss difference vs log10 N (version 4: through the size means)
    fit_compute: Fit | None  # loss difference vs log10 C
    paper: pf.PaperValue | None = None
    lack_of_fit: LackOfFit | None = None  # the line through every per-seed point against the size means
    rules: Rules = CURRENT

    @property
    def slope_word(self) -> str | None:
        """flat / shrinking / growing of the gap with N (None without a slope interval). Version 4:
        "no line" when the lack-of-fit test rejects the straight line (the per-size gaps are then
        the statement and no trend word is given)."""
        if self.fit_params is None:
            return None
        if self.rules.sweep_slope == "size means" and self.lack_of_fit is not None and self.lack_of_fit.rejects:
            return NO_LINE
        iv = self.fit_params.slope_interval()
        if not iv.defined:
            return None
        if iv.contains(0.0):
            return FLAT
        mean = sum(d for _, d in self.points) / len(self.points)
        return GROWING if (iv.estimate > 0) == (mean >= 0) else SHRINKING


@dataclass
class Scaling:
    runs: list[ScalingRun]
    sizes: list[str]  # ascending N
    size_params: dict[str, int]
    size_tokens: dict[str, int]  # tokens of the size's Q-K-V runs (else any run)
    variants: list[VariantScaling]
    source: str = "validation"  # what was scored: "test split" or "validation"
    train_tokens: int | None = None  # tokens of the training split (compare.json): what epochs count
    rules: Rules = CURRENT  # the analysis rules applied

    def epochs(self, size: str) -> float | None:
        """Passes over the training split the size's runs made (None when the split is not recorded)."""
        return self.size_tokens[size] / self.train_tokens if self.train_tokens else None

    def size_compute(self, size: str) -> float:
        return 6.0 * self.size_params[size] * self.size_tokens[size]

    @property
    def largest(self) -> int:
        return max(self.size_params.values())


def gap_pct(d: float) -> float:
    """A loss difference (nats) as a perplexity change in percent."""
    return 100.0 * math.expm1(d)


def predict_gap(fit: Fit, n: float, largest: int) -> Interval:
    """The line's gap (% perplexity) at N = n with a 95% prediction interval for one run; refused
    beyond MAX_EXTRAPOLATION x the largest size trained."""
    if n > MAX_EXTRAPOLATION * largest:
        raise ValueError(
            f"N={n:.3g} is {n / largest:.0f}x the largest size trained ({largest}); "
            f"predictions stop at {MAX_EXTRAPOLATION:g}x"
        )
    return fit.predict(math.log10(n)).map(gap_pct)


def _size_table(runs: Sequence[ScalingRun]) -> tuple[list[str], dict[str, int], dict[str, int]]:
    size_params: dict[str, int] = {}
    for r in sorted(runs, key=lambda r: r.variant != BASELINE):  # Q-K-V's own count first
        size_params.setdefault(r.size, r.params if r.variant == BASELINE else r.size_params)
    sizes = sorted(size_params, key=size_params.get)
    size_tokens = {}
    for s in sizes:
        base = [r.tokens for r in runs if r.size == s and r.variant == BASELINE] or [
            r.tokens for r in runs if r.size == s
        ]
        size_tokens[s] = max(base)
    return sizes, size_params, size_tokens


def _fits(points, x_of, level, rules: Rules) -> tuple[Fit | None, LackOfFit | None]:
    """The line in x_of(size): through the size means (version 4; each size one point, so seeds are
    not counted as sizes) or through every per-seed point (versions <= 3); and the lack-of-fit test
    of the line through every point against the size means."""
    if len({x_of(s) for s, _ in points}) < 2:  # cells of a grid at one N (a factorial): no line to fit
        return None, None
    xs, ys = [x_of(s) for s, _ in points], [d for _, d in points]
    lof = lack_of_fit(xs, ys)
    if rules.sweep_slope == "per seed":
        return ols(xs, ys, level), lof
    sizes = list(dict.fromkeys(s for s, _ in points))
    means = [sum(d for s2, d in points if s2 == s) / sum(1 for s2, _ in points if s2 == s) for s in sizes]
    return ols([x_of(s) for s in sizes], means, level), lof


def analyse(
    runs: Sequence[ScalingRun],
    level=LEVEL,
    source: str = "validation",
    rules: Rules = CURRENT,
    train_tokens: int | None = None,
) -> Scaling:
    """Per variant: paired gaps per size, line fits vs log10 N and log10 C (under the rules given)."""
    sizes, size_params, size_tokens = _size_table(runs)
    base = {(r.size, r.seed): Measured(r.val_loss, r.se, 0, r.per_unit) for r in runs if r.variant == BASELINE}
    log_c = {s: math.log10(6.0 * size_params[s] * size_tokens[s]) for s in sizes}
    out = []
    for v in dict.fromkeys(r.variant for r in runs if r.variant != BASELINE):
        gaps, points = {}, []
        for s in sizes:
            mine = {r.seed: Measured(r.val_loss, r.se, 0, r.per_unit) for r in runs if r.variant == v and r.size == s}
            ref = {seed: m for (size, seed), m in base.items() if size == s}
            est = paired_estimate(mine, ref, rules.eval_variance)
            if est is not None:
                gaps[s] = est.interval(level).map(gap_pct)
                points += [(s, mine[k].value - ref[k].value) for k in sorted(mine) if k in ref]
        fit_n, lof = _fits(points, lambda s: math.log10(size_params[s]), level, rules)
        fit_c, _ = _fits(points, log_c.get, level, rules)
        out.append(VariantScaling(v, gaps, points, fit_n, fit_c, pf.lm_ppl_change(v), lof, rules))
    return Scaling(list(runs), sizes, size_params, size_tokens, out, source, train_tokens, rules)


# ---- reading run folders -----------------------------------------------------------------------
def _variant_name(cfg, folder: str) -> str:
    """The variant a run trained, from its model config (scheme, key/value heads, matched MLP);
    the folder name when the config alone does not spell it (e.g. /width=SCHEME)."""
    kv = cfg.kv_heads if cfg.kv_heads not in (None, cfg.n_head) else None
    match = parse_scheme(cfg.match_params).name if cfg.match_params else None
    v = Variant(cfg.spec.name, kv, match)
    return v.name if v.slug == folder else folder


def _read_one(root: Path, d: Path) -> tuple[ScalingRun, dict | None] | None:
    """A finished run folder as a ScalingRun (validation loss) and its test.json; None: no loss."""
    rel = d.relative_to(root)
    cfg, body = read_config(d)
    train = body.get("train", {})
    base = cfg.replace(attn=BASELINE, kv_heads=None, match_params=None)
    rows = [r for r in read_metrics(d) if r.get("val_loss") is not None]
    if not rows:
        return None
    seed = (train.get("config") or {}).get("seed")
    run = ScalingRun(
        size=rel.parts[0],
        variant=_variant_name(cfg, rel.parts[-2]),
        seed=int(seed if seed is not None else rel.parts[-1].removeprefix("seed")),
        params=analytic_params(cfg).non_embedding,
        params_total=analytic_params(cfg).total,
        size_params=analytic_params(base).non_embedding,
        tokens=int(train.get("tokens") or rows[-1].get("tokens") or 0),
        val_loss=float(rows[-1]["val_loss"]),
        steps=int(train.get("step") or rows[-1].get("step") or 0),
        train_s=float(rows[-1].get("elapsed_s") or 0.0),
        dir=str(rel),
        config=config_fingerprint(train["config"]) if isinstance(train.get("config"), dict) else "",
    )
    return run, read_test(d)


def read_runs(runs_dir: str | Path) -> tuple[list[ScalingRun], list[str], str]:
    """Every finished run under runs_dir (OUT/<size>/<variant>/seed<k>), the unfinished ones'
    folders, and what was scored: the test split's loss (test.json's val_loss and se) when every
    finished run has one, else the last validation loss. A run's variant and N come from its
    config.json (the model as trained)."""
    root = Path(runs_dir)
    done: list[tuple[ScalingRun, dict | None]] = []
    unfinished = []
    for metrics in sorted(root.glob("*/*/*/metrics.jsonl")):
        d = metrics.parent
        one = _read_one(root, d) if run_finished(d) else None
        if one is None:
            unfinished.append(str(d.relative_to(root)))
        else:
            done.append(one)
    tests = [test_value(t, "val_loss") for _, t in done]
    if done and all(tests):
        runs = [replace(r, val_loss=tv[0], se=tv[1], per_unit=tv[3]) for (r, _), tv in zip(done, tests)]
        return [_as_recorded(r) for r in runs], unfinished, "test split"
    return [_as_recorded(r) for r, _ in done], unfinished, "validation"


def _as_recorded(r: ScalingRun) -> ScalingRun:
    """The run to the digits results.csv keeps, so a run scored from its folder and the same run read
    back from the table give the same figures (a sweep may mix both)."""
    return replace(r, val_loss=round(r.val_loss, 6), se=round(r.se, 6), train_s=round(r.train_s, 1))


SCORES = "scores.json"  # beside a sweep's results.csv: every run's per-window test losses


def write_unit_scores(out_dir: str | Path, runs: Sequence[ScalingRun]) -> None:
    """scores.json: per run (by its folder) its test windows' losses to 1e-6, one run per line, for
    re-rendering with the paired per-unit evaluation variance; nothing when no run has them."""
    have = [r for r in runs if r.per_unit]
    if not have:
        return
    lines = [json.dumps({"dir": r.dir, "per_unit": [round(x, UNIT_DIGITS) for x in r.per_unit]}) for r in have]
    atomic_write(
        Path(out_dir) / SCORES, '{"format": "qkvlab sweep scores 1", "runs": [\n' + ",\n".join(lines) + "\n]}\n"
    )


def _unit_scores(folder: Path) -> dict[str, tuple[float, ...]]:
    path = folder / SCORES
    if not path.is_file():
        return {}
    try:
        return {r["dir"]: tuple(r["per_unit"]) for r in json.loads(path.read_text())["runs"]}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a sweep's scores file ({type(e).__name__}: {e})") from None


def read_runs_csv(path: str | Path) -> list[ScalingRun]:
    """The runs of a results.csv this module wrote (one row per run), with their per-window test
    losses when scores.json lies beside it: what re-renders a sweep whose run folders are gone."""
    rows = list(csv.DictReader(Path(path).open()))
    units = _unit_scores(Path(path).parent)
    return [
        ScalingRun(
            size=r["size"],
            variant=r["variant"],
            seed=int(r["seed"]),
            params=int(r["params"]),
            params_total=int(r["params_total"]),
            size_params=int(r["size_params"]),
            tokens=int(r["tokens"]),
            val_loss=float(r["val_loss"]),
            steps=int(r["steps"]),
            dir=r.get("dir", ""),
            train_s=float(r.get("train_s") or 0.0),
            se=float(r.get("val_loss_se") or 0.0),
            per_unit=units.get(r.get("dir", "")),
            config=r.get("config") or "",
        )
        for r in rows
    ]
