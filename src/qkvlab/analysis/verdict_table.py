"""The verdicts as results.md shows them: one row per claim (the deciding comparison with its 90%
interval, the paper's figure, when the claim is reproduced and when contradicted, the word, the
seeds a decision needs) and the commands that would decide the undecided ones."""

from __future__ import annotations

import math
from collections.abc import Sequence

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis.seeds import decide_command, decide_seconds, seeds_cell, seeds_to_decide
from qkvlab.analysis.verdicts import (
    CONTRADICTED,
    INCONCLUSIVE,
    REPRODUCED,
    WORDS,
    ClaimVerdict,
    Gap,
    Region,
    pair_margin,
)
from qkvlab.base.units import fmt_duration


def _num(x: float, unit: str) -> str:
    if unit == "":
        return f"{x:.4f}" if 0.99 < x < 1 else f"{x:.3f}"
    return f"{x:+.2f}" if unit == "%" else f"{x:+.1f}"


def _with_unit(x: float, unit: str) -> str:
    return _num(x, unit) + ("%" if unit == "%" else f" {unit}" if unit else "")


def format_gap(g: Gap) -> str:
    """e.g. 'Q-K=V vs Q-K-V: +13.01% [+8.20, +17.95] (n=3)'; one seed: its evaluation-only
    interval or none."""
    iv, u = g.interval, g.unit
    head = f"{g.a} vs {g.b}: " if g.b else f"{g.a}: "
    if g.method == "McNemar":
        e = g.est
        return (
            f"{head}solved {e.a_solved}/{e.n} vs {e.b_solved}/{e.n} seeds, discordant {e.a_only}:{e.b_only}, "
            f"exact McNemar p = {g.p_holds:.3g}"
        )
    if g.method == "solve rate":
        head += "solve rate "
    ci = f" [{_num(iv.lo, u)}, {_num(iv.hi, u)}]" if iv.defined else " (no interval)"
    tail = f" (exact, {g.est.n} units)" if g.method == "exact" else f" (n={iv.n})"
    return f"{head}{_with_unit(iv.estimate, u)}{ci}{tail}"


def _bound(x: float, unit: str) -> str:
    """A region's bound at the precision of the figures beside it: two decimals for % (-0.862496% reads
    -0.86%, -0.596421% reads -0.60%), at most two for points and four without a unit, where margins are
    hand-set or halves of a paper's figure (+2.15 pts, 0.99); a whole number keeps its short form (+2%)."""
    x = round(x, 4 if unit == "" else 2)
    if x == 0:
        return "0"
    number = f"{x:+.2f}" if unit == "%" and x != int(x) else f"{x:+g}"
    return f"{number}%" if unit == "%" else f"{number} pts" if unit == "pts" else number.lstrip("+")


def holds_text(r: Region, unit: str, method: str = "") -> str:
    if method == "McNemar":
        return "solves less often, p < 5%" if r.holds[1] == 0 else "solves more often, p < 5%"
    lo, hi = r.holds
    if lo == -math.inf:
        return f"below {_bound(hi, unit)}"
    if hi == math.inf:
        return f"above {_bound(lo, unit)}"
    return f"within ±{_bound(hi, unit).lstrip('+')}"


def fails_text(r: Region, unit: str, method: str = "") -> str:
    if method == "McNemar":
        return "solves more often, p < 5%" if r.holds[1] == 0 else "solves less often, p < 5%"
    if len(r.fails) == 2:
        return f"beyond ±{_bound(r.fails[1][1], unit).lstrip('+')}"
    side, x = r.fails[0]
    return f"{side} {_bound(x, unit)}"


def _paper(g: Gap) -> str:
    if g.paper is None:
        return "–"
    return _with_unit(g.paper, g.unit) + (" (accuracy)" if g.method in ("solve rate", "McNemar") else "")


def _summary(tested: Sequence[ClaimVerdict]) -> str:
    counts = {w: sum(v.word == w for v in tested) for w in WORDS}
    n = len(tested)
    return (
        f"Of {n} claim{'' if n == 1 else 's'} tested here: {counts[REPRODUCED]} reproduced, "
        f"{counts[CONTRADICTED]} contradicted, {counts[INCONCLUSIVE]} inconclusive (one-sided tests at 5% "
        "over seeds, Holm within a claim; intervals shown at 90%: each bound is a one-sided 95% bound)."
    )


def _commands(tested, runs_per_seed: int, seconds_per_run: float | None, command: str) -> list[str]:
    """One line per distinct seed count an undecided claim needs: the command and its cost."""
    by_n: dict[int, list[str]] = {}
    for v in tested:
        n = seeds_to_decide(v)
        if n is not None and n != math.inf:
            by_n.setdefault(n, []).append(v.claim.id)
    if not by_n:
        return []
    have = min(v.seeds for v in tested)
    lines = ["", "To decide the inconclusive claims (seeds per variant from this run's spread, docs/analysis.md):", ""]
    for n in sorted(by_n):
        cost = ""
        if seconds_per_run and runs_per_seed:
            extra = max(0, n - have) * runs_per_seed
            cost = (
                f" ({extra} more runs, ≈ {fmt_duration(decide_seconds(n, have, runs_per_seed, seconds_per_run))} here)"
            )
        lines.append(f"- `{decide_command(command, n)}`{cost}: {', '.join(by_n[n])}")
    return lines


def verdicts_markdown(
    verdicts: Sequence[ClaimVerdict],
    *,
    runs_per_seed: int = 0,
    seconds_per_run: float | None = None,
    command: str = "",
) -> str:
    """A summary line, the table, the claims not tested and the commands that would decide the rest.
    seconds_per_run: wall seconds one run takes on this machine with its parallel jobs (the lead's
    measurement, or the folder's own); runs_per_seed: runs the command trains per added seed."""
    if not verdicts:
        return "No claim of the papers covers these tasks.\n"
    tested = [v for v in verdicts if v.word is not None]
    untested = [v for v in verdicts if v.word is None]
    lines = [_summary(tested), ""]
    if tested:
        lines += [
            "| claim | scored on | measured (deciding comparison, 90% CI) | paper | reproduced when | "
            "contradicted when | verdict | seeds to decide |",
            "| --- | --- | --- | ---: | --- | --- | --- | ---: |",
        ]
        for v in tested:
            g = v.decisive
            extra = f" ({len(v.gaps)} comparisons)" if len(v.gaps) > 1 else ""
            smaller = [x for x in v.gaps if x.smaller_than_paper]
            if smaller:  # the ordering holds; its size is excluded from the paper's (half its gap)
                extra += "; smaller than the paper's effect: " + ", ".join(f"{x.a} vs {x.b}" for x in smaller)
            lines.append(
                f"| Paper {v.claim.paper}: {v.claim.text} | {v.source or '–'} | {format_gap(g)}{extra} | {_paper(g)} "
                f"| {holds_text(g.region, g.unit, g.method)} | {fails_text(g.region, g.unit, g.method)} | **{v.word}** "
                f"| {seeds_cell(v, runs_per_seed, seconds_per_run)} |"
            )
    if untested:
        lines += [
            "",
            f"Not tested ({len(untested)}): " + "; ".join(f"{v.claim.text} ({v.note})" for v in untested) + ".",
        ]
    lines += _commands(tested, runs_per_seed, seconds_per_run, command)
    return "\n".join(lines) + "\n"


def claim_pairs(c: pc.Claim) -> list[tuple[str, str]]:
    """The compared pairs of an ordering claim as version 4 forms them (worst/best: against every
    other variant the paper ran)."""
    if c.kind in ("worst", "best"):
        return [(c.variants[0], v) for v in pc.paper_variants(c) if v != c.variants[0]]
    if c.kind == "order":
        return [(y, x) for x, y in zip(c.variants, c.variants[1:])]
    return [tuple(c.variants[:2])] if c.kind == "better" else []


def margins_markdown() -> str:
    """docs/analysis.md's margin table, from the claims themselves (a test keeps the two equal):
    version 4's margin of every compared pair and the per-claim margin versions 2-3 applied (– where a
    claim came later)."""
    kind_word = {
        "better": "smallest effect",
        "worst": "smallest effect",
        "best": "smallest effect",
        "order": "smallest effect",
        "close": "equivalence margin (±)",
        "spread": "equivalence margin (±), every pair",
        "at_most": "non-inferiority margin (+)",
        "at_least": "threshold",
    }
    lines = [
        "| claim | kind | margin (from v4: per compared pair) | v2–v3 | reason (from the paper alone) |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for c in pc.ALL_CLAIMS:
        lm = c.tasks == ("lm",)
        unit = "%" if lm else " pts"
        old = f"{c.threshold:g}" if c.kind == "at_least" else f"{c.margin:g}{unit}"
        if c.solve:
            value, old, why = "none (exact test)", "–", c.why
        elif c.kind in ("better", "worst", "best", "order"):
            cells = [(a, b, pair_margin(c.tasks, a, b, lm)) for a, b in claim_pairs(c)]
            # a pair the papers give no figure for takes the claim's own margin, as verdicts._pairs does
            value = "; ".join(f"{a} vs {b} {c.margin if m is None else m:g}{unit}" for a, b, m in cells)
            paired = all(m is not None for *_, m in cells)
            why = "half the paper's gap of each pair (the worse over the better)" if paired else c.why
        else:
            value, why = old, c.why
        if c.since > 3:  # the claim did not exist in versions 2-3
            old = "–"
        lines.append(f"| `{c.id}` (Paper {c.paper}) | {c.kind}: {kind_word[c.kind]} | {value} | {old} | {why} |")
    return "\n".join(lines) + "\n"
