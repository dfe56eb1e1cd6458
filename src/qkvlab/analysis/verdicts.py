"""The papers' claims -> one word each, by one-sided tests at 5% over seeds (docs/analysis.md).

Input is plain data: ``values[task][variant][key]`` = a run's final score, a float or a
:class:`Measured` (the score with its evaluation's own standard error and unit count), where the
pairing key is the seed (or ``(grid point, seed)``): runs with the same key share the data order and
the initialisation of every tensor they have in common, so the per-key difference cancels most of
the seed noise.

Every claim is a set of comparisons; each comparison states where the truth must lie for the claim
to hold and where it fails, in the gap's display unit (perplexity change in percent for language
modelling, metric points otherwise), with the claim's margin fixed in advance
(:mod:`qkvlab.analysis.paper_claims`):

- ordering (better, worst, best, order): holds when A is on the claimed side of B (one-sided test
  of "no difference"), fails when the effect is smaller than the margin (one-sided test of "an
  effect of the margin's size"); a real effect smaller than the margin fails too;
- close and spread: holds by TOST (both one-sided tests at 5%, i.e. the 90% interval inside
  ±margin), fails when the gap lies beyond +margin or below -margin;
- at_most: non-inferiority, holds when the cost is below the margin, fails when above;
- at_least: holds when the variant's score is above the threshold, fails when below.

A claim is ``reproduced`` when every comparison holds at 5% (an intersection-union test needs no
correction), ``contradicted`` when Holm's rule over the comparisons' failure tests rejects at least
one at 5%, ``inconclusive`` otherwise, and always with fewer than two seeds. A comparison that both
holds and fails (a real effect smaller than the margin) holds from analysis version 4 (it counted
as failed before; :mod:`qkvlab.analysis.rules`), and results.md says the effect is smaller than the
paper's. Shown intervals are the 90% ones: each bound is a one-sided 95% bound, the tests' own.
Every function takes the analysis rules to apply (default: the current version), so stored scores
can be scored again under any version.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.estimates import (
    Measured,
    Score,
    Values,
    _scores,
    level_estimate,
    paired_estimate,
    paired_solves,
    solve_estimate,
)
from qkvlab.analysis.intervals import (
    ALPHA,
    LEVEL,
    Interval,
    MeanEstimate,
    PairedSolves,
    Rate,
    RateDifference,
    holm,
)
from qkvlab.analysis.rules import CURRENT, Rules
from qkvlab.analysis.runs import test_value

REPRODUCED, CONTRADICTED, INCONCLUSIVE = "reproduced", "contradicted", "inconclusive"
WORDS = (REPRODUCED, CONTRADICTED, INCONCLUSIVE)
PERPLEXITY_METRIC = "val_loss"  # a task with this metric compares perplexities
TEST_LEVEL = 1 - 2 * ALPHA  # the shown interval: each bound a one-sided 1 - ALPHA bound
INF = math.inf


@dataclass(frozen=True)
class Region:
    """Where a comparison's truth must lie for the claim (holds: an open interval) and where the
    claim fails (rays: ("below", x) or ("above", x)), in the display unit."""

    holds: tuple[float, float]
    fails: tuple[tuple[str, float], ...]

    def raw(self, to_raw) -> Region:
        f = lambda x: x if math.isinf(x) else to_raw(x)
        return Region((f(self.holds[0]), f(self.holds[1])), tuple((s, f(x)) for s, x in self.fails))

    @property
    def overlap(self) -> float:
        """Width of the zone where the claim both holds and fails (ordering claims); 0 otherwise."""
        lo, hi = self.holds
        for side, x in self.fails:
            if side == "below" and x > lo:
                return min(x, hi) - lo
            if side == "above" and x < hi:
                return hi - max(x, lo)
        return 0.0


def p_holds(est, region: Region) -> float:
    lo, hi = region.holds
    return max(est.p_above(lo) if lo > -INF else 0.0, est.p_below(hi) if hi < INF else 0.0)


def p_fails(est, region: Region) -> float:
    return min(est.p_below(x) if side == "below" else est.p_above(x) for side, x in region.fails)


def ordering_region(better_up: bool, margin: float) -> Region:
    """A beats B (better_up: in the direction of a higher gap) by at least margin."""
    return Region((0.0, INF), (("below", margin),)) if better_up else Region((-INF, 0.0), (("above", -margin),))


def band_region(margin: float) -> Region:
    return Region((-margin, margin), (("below", -margin), ("above", margin)))


def cost_region(worse_up: bool, margin: float) -> Region:
    """A costs at most margin over B (worse_up: a higher gap is worse)."""
    return Region((-INF, margin), (("above", margin),)) if worse_up else Region((-margin, INF), (("below", -margin),))


def threshold_region(higher_is_better: bool, threshold: float) -> Region:
    up = Region((threshold, INF), (("below", threshold),))
    return up if higher_is_better else Region((-INF, threshold), (("above", threshold),))


# ---- comparisons ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gap:
    """One comparison of a claim: A against B (b "" for a threshold on A itself)."""

    a: str
    b: str
    interval: Interval  # in unit, at TEST_LEVEL
    unit: str  # "%" (perplexity change) or "pts" (metric points) or "" (the metric itself)
    region: Region  # in unit
    word: str
    paper: float | None  # the paper's figure for the same gap, in unit
    est: MeanEstimate | RateDifference | Rate | PairedSolves | None = None  # raw units (nats, metric fractions)
    raw_region: Region | None = None
    p_holds: float = 1.0
    p_fails: float = 1.0
    method: str = "paired t"  # or "solve rate" (Newcombe), "McNemar" (paired exact), "exact" (Clopper-Pearson)
    smaller_than_paper: bool = False  # an ordering that holds with the effect excluded from the margin's size

    def _distance(self) -> float:
        """How far inside the holding region the interval is (negative: sticks out)."""
        if not self.interval.defined:
            return -INF
        return min(self.interval.lo - self.region.holds[0], self.region.holds[1] - self.interval.hi)


@dataclass(frozen=True)
class ClaimVerdict:
    claim: pc.Claim
    word: str | None  # None: not tested (a task or variant it needs was not run)
    gaps: tuple[Gap, ...] = ()
    note: str = ""
    source: str = ""  # what was scored: "test split, n=..." or "validation"

    @property
    def decisive(self) -> Gap | None:
        """The comparison that decided: the first contradicted one, else the first inconclusive
        one, else the one closest to its region's edge."""
        for w in (CONTRADICTED, INCONCLUSIVE):
            hit = [g for g in self.gaps if g.word == w]
            if hit:
                return min(hit, key=lambda g: g.p_fails) if w == CONTRADICTED else hit[0]
        return min(self.gaps, key=Gap._distance) if self.gaps else None

    @property
    def seeds(self) -> int:
        return min((g.interval.n for g in self.gaps), default=0)


def to_display(unit: str, perplexity: bool):
    if unit == "":
        return lambda x: x
    return (lambda x: 100.0 * math.expm1(x)) if perplexity else (lambda x: 100.0 * x)


def to_raw(unit: str, perplexity: bool):
    if unit == "":
        return lambda x: x
    return (lambda x: math.log1p(x / 100.0)) if perplexity else (lambda x: x / 100.0)


def gap_interval(a, b, perplexity: bool, eval_variance: str = "paired units", level: float = LEVEL) -> Interval | None:
    """Paired interval of A - B over common keys, in display units (None without a common key)."""
    est = paired_estimate(a, b, eval_variance)
    return None if est is None else est.interval(level).map(to_display("%" if perplexity else "pts", perplexity))


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


def pair_margin(tasks: Sequence[str], a: str, b: str, perplexity: bool) -> float | None:
    """The smallest effect of interest of one compared pair, the same in every claim that compares it
    (analysis version 4): half the paper's own gap of the pair's worse over its better variant, in
    display units (2 decimals, as docs/analysis.md prints it); None when the paper reports none."""
    gaps = [g for g in (paper_gap(tasks, a, b, perplexity), paper_gap(tasks, b, a, perplexity)) if g is not None]
    return round(pc.SESOI_FRACTION * max(gaps), 2) if gaps else None  # the worse over the better: symmetric


def decide(est, raw_region: Region, seeds: int) -> tuple[float, float]:
    """(p_holds, p_fails) of a comparison; both 1 with fewer than two seeds (one seed's interval
    holds evaluation noise only: the seed-to-seed spread is unknown)."""
    if est is None or seeds < 2:
        return 1.0, 1.0
    return p_holds(est, raw_region), p_fails(est, raw_region)


def _words(gaps: list[Gap], rules: Rules = CURRENT) -> tuple[str, list[Gap]]:
    """The claim's word and its gaps with their own words (Holm over the failure tests). A
    comparison that both holds and fails (an ordering whose effect is real but excluded from the
    margin's size) is failed under versions <= 3 and holds from version 4 (the ordering is what the
    claim's words say; the size is reported as smaller than the paper's)."""
    fails = holm([g.p_fails for g in gaps])
    out = []
    for g, f in zip(gaps, fails):
        holds = g.p_holds < ALPHA
        if rules.overlap == "holds" and holds:
            w = REPRODUCED
        else:
            w = CONTRADICTED if f else REPRODUCED if holds else INCONCLUSIVE
        out.append(replace(g, word=w, smaller_than_paper=bool(holds and f)))
    if any(g.word == CONTRADICTED for g in out):
        return CONTRADICTED, out
    return (REPRODUCED if out and all(g.word == REPRODUCED for g in out) else INCONCLUSIVE), out


@dataclass(frozen=True)
class _Setup:
    tasks: tuple[str, ...]
    hib: bool
    perplexity: bool
    solve: bool  # single solve-or-fail task: compare solve rates
    rules: Rules = CURRENT

    @property
    def unit(self) -> str:
        return "%" if self.perplexity else "pts"


def _comparison(s: _Setup, scores, a: str, b: str, region: Region) -> Gap | None:
    paper = paper_gap(s.tasks, a, b, s.perplexity)
    raw = region.raw(to_raw(s.unit, s.perplexity))
    if s.solve and s.rules.solve == "mcnemar":
        est = paired_solves(scores[a], scores[b])
        if est is None:
            return None
        less = region.holds[1] == 0.0  # the claim: A solves less often than B
        ph, pfail = (est.p_less(), est.p_more()) if less else (est.p_more(), est.p_less())
        if est.n < 2:
            ph, pfail = 1.0, 1.0
        iv = est.interval().map(to_display(s.unit, s.perplexity))
        return Gap(a, b, iv, s.unit, region, INCONCLUSIVE, paper, est, raw, ph, pfail, "McNemar")
    if s.solve:
        est = solve_estimate(scores[a], scores[b])
    else:
        est = paired_estimate(scores[a], scores[b], s.rules.eval_variance)
    if est is None:
        return None
    ph, pfail = decide(est, raw, est.n)
    iv = est.interval(TEST_LEVEL).map(to_display(s.unit, s.perplexity))
    method = "solve rate" if s.solve else "paired t"
    return Gap(a, b, iv, s.unit, region, INCONCLUSIVE, paper, est, raw, ph, pfail, method)


def _threshold_gaps(claim: pc.Claim, s: _Setup, scores) -> list[Gap]:
    region = threshold_region(s.hib, claim.threshold)
    gaps = []
    for v, sc in scores.items():
        est = level_estimate(sc)
        ph, pfail = decide(est, region, len(sc))
        paper = _paper_score(s.tasks, v, s.perplexity)
        method = "exact" if isinstance(est, Rate) else "t"
        iv = replace(est.interval(TEST_LEVEL), n=len(sc))  # n: seeds (an exact rate counts units)
        gaps.append(
            Gap(v, "", iv, "", region, INCONCLUSIVE, paper[0] if paper else None, est, region, ph, pfail, method)
        )
    return gaps


def _pairs(claim: pc.Claim, s: _Setup, scores) -> list[tuple[str, str, Region]] | str:
    """The claim's comparisons (A, B, region), or why it cannot be tested. Version 4: worst/best
    rank over the variants the paper ran, and every ordering comparison takes its pair's margin."""
    kind, names, m = claim.kind, claim.variants, claim.margin
    per_pair = s.rules.margins == "per pair" and not claim.solve

    def region(up: bool, a: str, b: str) -> Region:
        pm = pair_margin(s.tasks, a, b, s.perplexity) if per_pair else None
        if pm is None:
            return ordering_region(up, m)
        if s.perplexity and not up:  # A better: B's perplexity over A's by pm%, i.e. A's over B's by 1/(1+pm)
            pm = 100.0 * (1.0 - 1.0 / (1.0 + pm / 100.0))
        return ordering_region(up, pm)

    if kind in ("better", "close", "at_most", "order") and any(v not in scores for v in names):
        return f"variant {next(v for v in names if v not in scores)} not run"
    if kind == "better":
        return [(names[0], names[1], region(s.hib, names[0], names[1]))]
    if kind == "close":
        return [(names[0], names[1], band_region(m))]
    if kind == "at_most":
        return [(names[0], names[1], cost_region(not s.hib, m))]
    if kind in ("worst", "best"):
        target = names[0]
        pool = [v for v in scores if s.rules.among == "run" or v in pc.paper_variants(claim)]
        if target not in scores or len(pool) < 3:
            return f"needs {target} and at least two other variants" + (
                " the paper ran" if s.rules.among == "paper" else ""
            )
        up = s.hib if kind == "best" else not s.hib
        return [(target, v, region(up, target, v)) for v in pool if v != target]
    if kind == "order":
        return [(y, x, region(not s.hib, y, x)) for x, y in zip(names, names[1:])]
    if kind == "spread":
        if len(scores) < 2:
            return "needs at least two variants"
        vs = list(scores)
        return [(a, b, band_region(m)) for i, a in enumerate(vs) for b in vs[i + 1 :]]
    raise ValueError(f"unknown claim kind {kind!r}")


def check(
    claim: pc.Claim,
    values: Values,
    higher_is_better: Mapping[str, bool],
    metric: Mapping[str, str],
    source="",
    rules: Rules = CURRENT,
):
    """One claim's verdict on a results table (see the module doc for the rules) under the
    analysis rules given (default: the current version)."""
    tasks = claim.tasks
    missing_tasks = [t for t in tasks if t not in values]
    if missing_tasks:
        return ClaimVerdict(claim, None, note=f"task {missing_tasks[0]} not run")
    perplexity = metric.get(tasks[0]) == PERPLEXITY_METRIC
    single_solve_task = len(tasks) == 1 and tasks[0] in pc.SOLVE_OR_FAIL_TASKS and claim.kind != "at_least"
    # versions <= 3 read every reverse/swap claim as solve rates; from 4 only the solve-or-fail claims
    solve = claim.solve or (single_solve_task and rules.solve == "newcombe")
    s = _Setup(tuple(tasks), higher_is_better.get(tasks[0], True), perplexity, solve, rules)
    present = sorted(set.intersection(*(set(values[t]) for t in tasks)))
    scores = {v: sc for v in present if (sc := _scores(values, tasks, v))}
    if claim.kind == "at_least":
        if len(scores) < 2:
            return ClaimVerdict(claim, None, note="needs at least two variants")
        word, gaps = _words(_threshold_gaps(claim, s, scores), rules)
        return ClaimVerdict(claim, word, tuple(gaps), source=source)
    pairs = _pairs(claim, s, scores)
    if isinstance(pairs, str):
        return ClaimVerdict(claim, None, note=pairs)
    gaps = [_comparison(s, scores, a, b, region) for a, b, region in pairs]
    if any(g is None for g in gaps):
        a, b, _ = pairs[[g is None for g in gaps].index(True)]
        return ClaimVerdict(claim, None, note=f"{a} and {b} share no seed")
    word, gaps = _words(gaps, rules)
    return ClaimVerdict(claim, word, tuple(gaps), source=source)


def check_claims(
    values: Values,
    higher_is_better: Mapping[str, bool],
    metric: Mapping[str, str],
    claims: Sequence[pc.Claim] = pc.ALL_CLAIMS,
    sources: Mapping[str, str] | None = None,
    rules: Rules = CURRENT,
) -> list[ClaimVerdict]:
    """Verdicts for the claims that touch a task of values (tested or not) and that the rules'
    version has (a claim introduced later is left out); sources: per task, what was scored."""
    out = []
    for c in claims:
        if c.since <= rules.version and any(t in values for t in c.tasks):
            src = "; ".join(dict.fromkeys((sources or {}).get(t, "") for t in c.tasks if t in values)).strip("; ")
            out.append(check(c, values, higher_is_better, metric, src, rules))
    return out


# ---- from runs -----------------------------------------------------------------------------------
def pairing_key(run) -> tuple[str, int]:
    """What pairs runs across variants: the grid point (if any) and the seed."""
    return (getattr(run, "point", "") or "", int(run.seed))


def final_value(run, metric: str) -> float | None:
    """The run's last evaluated value of metric (None when it never evaluated it)."""
    return next((float(r[metric]) for r in reversed(run.history) if r.get(metric) is not None), None)


def _test_score(run, metric: str) -> Measured | None:
    tv = test_value(getattr(run, "test", None), metric)
    return None if tv is None else Measured(*tv)


def _by_task(runs: Sequence, metric: Mapping[str, str]) -> dict[str, tuple[list, list[Measured | None] | None]]:
    """task -> (its runs, their test scores when every run of the task has one, else None)."""
    groups: dict[str, list] = {}
    for r in runs:
        if r.task in metric:
            groups.setdefault(r.task, []).append(r)
    out = {}
    for task, group in groups.items():
        tests = [_test_score(r, metric[task]) for r in group]
        out[task] = (group, tests if all(t is not None for t in tests) else None)
    return out


def values_from_runs(runs: Sequence, metric: Mapping[str, str]) -> dict[str, dict[str, dict[Hashable, Score]]]:
    """Runs (task, variant, seed, history, optionally point and test) -> the table check_claims
    reads: task -> variant -> pairing key -> score. The score is the test split's (test.json's
    metric with its se and unit count) when every run of the task has one, else every run's last
    validation value."""
    out: dict[str, dict[str, dict[Hashable, Score]]] = {}
    for task, (group, tests) in _by_task(runs, metric).items():
        for i, r in enumerate(group):
            v = tests[i] if tests else final_value(r, metric[task])
            if v is not None:
                out.setdefault(task, {}).setdefault(r.variant, {})[pairing_key(r)] = v
    return out


def score_sources(runs: Sequence, metric: Mapping[str, str]) -> dict[str, str]:
    """Per task, what values_from_runs scored: 'test split, n=10000 lists' or 'validation'."""
    out = {}
    for task, (group, tests) in _by_task(runs, metric).items():
        if tests is None:
            out[task] = "validation"
            continue
        ns = sorted({t.units for t in tests})
        units = "/".join(sorted({str(r.test.get("units") or "units") for r in group}))
        out[task] = f"test split, n={ns[0] if len(ns) == 1 else f'{ns[0]}–{ns[-1]}'} ({units})"
    return out
