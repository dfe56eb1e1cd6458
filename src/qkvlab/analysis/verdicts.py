"""The papers' claims -> one word each, decided by paired 95% intervals over seeds.

Input is plain data: ``values[task][variant][key]`` = a run's final metric, where the pairing key
is the seed (or ``(grid point, seed)``): runs with the same key share the data order and the
initialisation of their shared parts, so the per-key difference cancels most of the seed noise.

Every claim compares variants through gaps. The gap of A against B is, per key, the difference of
their scores (a score is the mean over the claim's tasks); its mean gets a t-interval over keys
(df = keys - 1; one key: no interval). Units: for language modelling (metric ``val_loss``) the
perplexity change of A vs B in percent, 100 (exp(mean loss difference) - 1), the interval mapped
the same way; for tasks the metric difference in points (hundredths: accuracy .851 -> 85.1).

A claim states a region the gap must lie in; the word is

- ``reproduced``: the interval lies inside the region;
- ``contradicted``: the interval lies outside it (excludes the paper's claim);
- ``inconclusive``: otherwise, and always when the interval is undefined (one seed).

Regions by claim kind (see :class:`qkvlab.analysis.paper_figures.Claim`): "better" A beats B:
gap > 0 in the metric's better direction; "worst"/"best": that, against every other variant run;
"order": each variant worse than the one before; "close": |gap| < margin; "at_most": A's cost over
B below margin; "spread": every pair within ±margin; "at_least": each variant's own t-interval
above the claim's threshold (in the metric's units). A claim of several comparisons is
reproduced when all are, contradicted when any is, inconclusive otherwise. No correction for
multiple comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import LEVEL, Interval, mean_interval, paired_differences

REPRODUCED, CONTRADICTED, INCONCLUSIVE = "reproduced", "contradicted", "inconclusive"
WORDS = (REPRODUCED, CONTRADICTED, INCONCLUSIVE)
PERPLEXITY_METRIC = "val_loss"  # a task with this metric compares perplexities

Values = Mapping[str, Mapping[str, Mapping[Hashable, float]]]  # task -> variant -> key -> value
INF = math.inf


def word_for(interval: Interval, lo: float, hi: float) -> str:
    """reproduced when interval lies inside the region (lo, hi), contradicted when it lies
    outside, inconclusive otherwise or when it is undefined."""
    if not interval.defined:
        return INCONCLUSIVE
    if lo < interval.lo and interval.hi < hi:
        return REPRODUCED
    if interval.hi <= lo or interval.lo >= hi:
        return CONTRADICTED
    return INCONCLUSIVE


def combine(words: Sequence[str]) -> str:
    if any(w == CONTRADICTED for w in words):
        return CONTRADICTED
    return REPRODUCED if words and all(w == REPRODUCED for w in words) else INCONCLUSIVE


@dataclass(frozen=True)
class Gap:
    """One comparison of a claim: A against B (b "" for a threshold on A itself)."""

    a: str
    b: str
    interval: Interval  # in unit
    unit: str  # "%" (perplexity change) or "pts" (metric points) or "" (the metric itself)
    region: tuple[float, float]  # where the claim needs the gap
    word: str
    paper: float | None  # the paper's figure for the same gap, in unit

    def _distance(self) -> float:
        """How far inside the region the interval is (negative: sticks out)."""
        if not self.interval.defined:
            return -INF
        return min(self.interval.lo - self.region[0], self.region[1] - self.interval.hi)


@dataclass(frozen=True)
class ClaimVerdict:
    claim: pf.Claim
    word: str | None  # None: not tested (a task or variant it needs was not run)
    gaps: tuple[Gap, ...] = ()
    note: str = ""

    @property
    def decisive(self) -> Gap | None:
        """The comparison that decided: the first contradicted one, else the first inconclusive
        one, else the one closest to its region's edge."""
        for w in (CONTRADICTED, INCONCLUSIVE):
            hit = [g for g in self.gaps if g.word == w]
            if hit:
                return max(hit, key=lambda g: abs(g.interval.estimate)) if w == CONTRADICTED else hit[0]
        return min(self.gaps, key=Gap._distance) if self.gaps else None


# ---- scores and gaps ---------------------------------------------------------------------------
def _scores(values: Values, tasks: Sequence[str], variant: str) -> dict[Hashable, float] | None:
    """Per key, the variant's mean over tasks (keys every task has); None when a task lacks it."""
    per_task = [values.get(t, {}).get(variant) for t in tasks]
    if any(not p for p in per_task):
        return None
    keys = set.intersection(*(set(p) for p in per_task))
    return {k: sum(p[k] for p in per_task) / len(per_task) for k in keys}


def gap_interval(a: Mapping[Hashable, float], b: Mapping[Hashable, float], perplexity: bool, level: float = LEVEL):
    """Paired interval of A - B over common keys, in display units (None without a common key)."""
    diffs = paired_differences(a, b)
    if not diffs:
        return None
    iv = mean_interval(diffs, level)
    return iv.map(lambda x: 100.0 * math.expm1(x)) if perplexity else iv.scale(100.0)


def _paper_score(tasks: Sequence[str], variant: str, perplexity: bool) -> tuple[float, str] | None:
    if perplexity:
        pv = pf.lm_ppl_change(variant)
        return (pv.value, pv.source) if pv else None
    vals = [pf.task_metric(t, variant) for t in tasks]
    return (sum(vals) / len(vals), "B") if vals and all(v is not None for v in vals) else None


def paper_gap(tasks: Sequence[str], a: str, b: str, perplexity: bool) -> float | None:
    """The papers' figure for the gap of a vs b in display units; None when not reported or when
    the two figures come from different papers' setups."""
    pa, pb = _paper_score(tasks, a, perplexity), _paper_score(tasks, b, perplexity)
    if pa is None or pb is None:
        return None
    if perplexity:
        if pa[1] != pb[1] and b != "Q-K-V" and a != "Q-K-V":
            return None
        return 100.0 * ((1 + pa[0] / 100) / (1 + pb[0] / 100) - 1)
    return 100.0 * (pa[0] - pb[0])


def _better_region(higher_is_better: bool) -> tuple[float, float]:
    return (0.0, INF) if higher_is_better else (-INF, 0.0)


def _worse_region(higher_is_better: bool) -> tuple[float, float]:
    return (-INF, 0.0) if higher_is_better else (0.0, INF)


def check(
    claim: pf.Claim, values: Values, higher_is_better: Mapping[str, bool], metric: Mapping[str, str], level=LEVEL
):
    """One claim's verdict on a results table (see the module doc for the rules)."""
    tasks = claim.tasks
    missing_tasks = [t for t in tasks if t not in values]
    if missing_tasks:
        return ClaimVerdict(claim, None, note=f"task {missing_tasks[0]} not run")
    hib = higher_is_better.get(tasks[0], True)
    perplexity = metric.get(tasks[0]) == PERPLEXITY_METRIC
    unit = "%" if perplexity else "pts"
    present = sorted(set.intersection(*(set(values[t]) for t in tasks)))
    scores = {v: s for v in present if (s := _scores(values, tasks, v))}

    def gap(a: str, b: str, region: tuple[float, float]) -> Gap | None:
        iv = gap_interval(scores[a], scores[b], perplexity, level)
        if iv is None:
            return None
        return Gap(a, b, iv, unit, region, word_for(iv, *region), paper_gap(tasks, a, b, perplexity))

    kind, names = claim.kind, claim.variants
    pairs: list[tuple[str, str, tuple[float, float]]] = []
    if kind in ("better", "close", "at_most"):
        if any(v not in scores for v in names):
            return ClaimVerdict(claim, None, note=f"variant {next(v for v in names if v not in scores)} not run")
        a, b = names
        if kind == "better":
            region = _better_region(hib)
        elif kind == "close":
            region = (-claim.margin, claim.margin)
        else:  # A's cost over B below the margin: worse by less than margin
            region = (-INF, claim.margin) if (perplexity or not hib) else (-claim.margin, INF)
        pairs = [(a, b, region)]
    elif kind in ("worst", "best"):
        target = names[0]
        if target not in scores or len(scores) < 3:
            return ClaimVerdict(claim, None, note=f"needs {target} and at least two other variants")
        region = _worse_region(hib) if kind == "worst" else _better_region(hib)
        pairs = [(target, v, region) for v in scores if v != target]
    elif kind == "order":
        if any(v not in scores for v in names):
            return ClaimVerdict(claim, None, note=f"variant {next(v for v in names if v not in scores)} not run")
        pairs = [(y, x, _worse_region(hib)) for x, y in zip(names, names[1:])]
    elif kind == "spread":
        if len(scores) < 2:
            return ClaimVerdict(claim, None, note="needs at least two variants")
        vs = list(scores)
        pairs = [(a, b, (-claim.margin, claim.margin)) for i, a in enumerate(vs) for b in vs[i + 1 :]]
    elif kind == "at_least":
        if len(scores) < 2:
            return ClaimVerdict(claim, None, note="needs at least two variants")
        region = (claim.threshold, INF) if hib else (-INF, claim.threshold)
        gaps = []
        for v, s in scores.items():
            iv = mean_interval(list(s.values()), level)
            paper = _paper_score(tasks, v, perplexity)
            gaps.append(Gap(v, "", iv, "", region, word_for(iv, *region), paper[0] if paper else None))
        return ClaimVerdict(claim, combine([g.word for g in gaps]), tuple(gaps))
    else:
        raise ValueError(f"unknown claim kind {kind!r}")

    gaps = [gap(a, b, region) for a, b, region in pairs]
    if any(g is None for g in gaps):
        a, b, _ = pairs[[g is None for g in gaps].index(True)]
        return ClaimVerdict(claim, None, note=f"{a} and {b} share no seed")
    return ClaimVerdict(claim, combine([g.word for g in gaps]), tuple(gaps))


def check_claims(
    values: Values,
    higher_is_better: Mapping[str, bool],
    metric: Mapping[str, str],
    claims: Sequence[pf.Claim] = pf.ALL_CLAIMS,
    level: float = LEVEL,
) -> list[ClaimVerdict]:
    """Verdicts for the claims that touch a task of values (tested or not)."""
    return [check(c, values, higher_is_better, metric, level) for c in claims if any(t in values for t in c.tasks)]


def pairing_key(run) -> tuple[str, int]:
    """What pairs runs across variants: the grid point (if any) and the seed."""
    return (getattr(run, "point", "") or "", int(run.seed))


def final_value(run, metric: str) -> float | None:
    """The run's last evaluated value of metric (None when it never evaluated it)."""
    return next((float(r[metric]) for r in reversed(run.history) if r.get(metric) is not None), None)


def values_from_runs(runs: Sequence, metric: Mapping[str, str]) -> dict[str, dict[str, dict[Hashable, float]]]:
    """Runs (anything with task, variant, seed, history and optionally point) -> the plain table
    check_claims reads: task -> variant -> pairing key -> final metric."""
    out: dict[str, dict[str, dict[Hashable, float]]] = {}
    for r in runs:
        if r.task in metric and (v := final_value(r, metric[r.task])) is not None:
            out.setdefault(r.task, {}).setdefault(r.variant, {})[pairing_key(r)] = v
    return out


# ---- rendering ---------------------------------------------------------------------------------
def _num(x: float, unit: str) -> str:
    if unit == "":
        return f"{x:.3f}"
    return f"{x:+.2f}" if unit == "%" else f"{x:+.1f}"


def format_gap(g: Gap) -> str:
    """e.g. 'Q-K=V vs Q-K-V: +13.01% [+8.20, +17.95] (n=3)'; one seed: no interval."""
    iv, u = g.interval, g.unit
    head = f"{g.a} vs {g.b}: " if g.b else f"{g.a}: "
    body = _num(iv.estimate, u) + ("%" if u == "%" else f" {u}" if u else "")
    ci = f" [{_num(iv.lo, u)}, {_num(iv.hi, u)}]" if iv.defined else " (no interval)"
    return f"{head}{body}{ci} (n={iv.n})"


def _bound(x: float, unit: str) -> str:
    if x == 0:
        return "0"
    return f"{x:+g}%" if unit == "%" else f"{x:+g} pts" if unit == "pts" else f"{x:g}"


def criterion(g: Gap) -> str:
    lo, hi = g.region
    if lo == -INF:
        return f"interval below {_bound(hi, g.unit)}"
    if hi == INF:
        return f"interval above {_bound(lo, g.unit)}"
    return f"interval within ±{_bound(hi, g.unit).lstrip('+')}"


def _paper(g: Gap) -> str:
    if g.paper is None:
        return "–"
    return _num(g.paper, g.unit) + ("%" if g.unit == "%" else f" {g.unit}" if g.unit else "")


def verdicts_markdown(verdicts: Sequence[ClaimVerdict]) -> str:
    """A summary line and a table: claim, measured gap with its 95% interval, the paper's figure
    for the same gap, the criterion, the word; then the claims not tested."""
    if not verdicts:
        return "No claim of the papers covers these tasks.\n"
    tested = [v for v in verdicts if v.word is not None]
    untested = [v for v in verdicts if v.word is None]
    counts = {w: sum(v.word == w for v in tested) for w in WORDS}
    lines = [
        f"Of {len(tested)} claim{'' if len(tested) == 1 else 's'} tested here: {counts[REPRODUCED]} reproduced, {counts[CONTRADICTED]} contradicted, "
        f"{counts[INCONCLUSIVE]} inconclusive (paired 95% t-intervals over seeds).",
        "",
    ]
    if tested:
        lines += [
            "| claim | measured (decisive comparison) | paper | reproduced when | verdict |",
            "| --- | --- | ---: | --- | --- |",
        ]
        for v in tested:
            g = v.decisive
            extra = f" ({len(v.gaps)} comparisons)" if len(v.gaps) > 1 else ""
            lines.append(
                f"| Paper {v.claim.paper}: {v.claim.text} | {format_gap(g)}{extra} | {_paper(g)} | {criterion(g)} "
                f"| **{v.word}** |"
            )
    if untested:
        lines += [
            "",
            f"Not tested ({len(untested)}): " + "; ".join(f"{v.claim.text} ({v.note})" for v in untested) + ".",
        ]
    return "\n".join(lines) + "\n"
