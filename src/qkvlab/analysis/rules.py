"""The analysis rules in one versioned place: which statistics turn stored scores into verdict words,
what changed in each version, when, and which documented runs had been scored before the change.

A results file records the version it was scored with (compare.json ``analysis_version``,
results.md's "Analysis rules" line) and the version the runs were trained under
(``trained_under_analysis``). When the two differ, results.md says which rules came after the data.
Any rule can be applied again to stored scores without retraining (``qkvlab compare --render``,
``--analysis-version N``), so an old table can be rebuilt beside the new one.

The fingerprint of the current rules (the claims with their margins, the constants, the switches
below) is pinned per version in CHANGELOG: a test fails when a rule or a margin changes without a new
version and a changelog entry (docs/analysis.md's history tells the same story in prose).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from qkvlab.analysis import paper_claims as pc
from qkvlab.base.errors import UserError

ANALYSIS_VERSION = 6


@dataclass(frozen=True)
class Rules:
    """The switches that differ between versions (every other rule is common to all of them)."""

    version: int
    eval_variance: str  # "independent": se_A^2 + se_B^2 added whole; "paired units": from per-unit scores
    overlap: str  # an ordering comparison that both holds and fails: "fails" (counts failed) or "holds"
    margins: str  # ordering margins: "per claim" (the claim's own) or "per pair" (one per compared pair)
    among: str  # worst/best over: "run" (every variant run) or "paper" (the variants the paper ran)
    solve: str  # solve-or-fail tasks: "newcombe" (unpaired solve rates) or "mcnemar" (paired, exact)
    sweep_slope: str  # "per seed" (every per-seed point) or "size means" (with a lack-of-fit F test)


VERSIONS = {
    2: Rules(2, "independent", "fails", "per claim", "run", "newcombe", "per seed"),
    3: Rules(3, "paired units", "fails", "per claim", "run", "newcombe", "per seed"),
    4: Rules(4, "paired units", "holds", "per pair", "paper", "mcnemar", "size means"),
    5: Rules(5, "paired units", "holds", "per pair", "paper", "mcnemar", "size means"),
    6: Rules(6, "paired units", "holds", "per pair", "paper", "mcnemar", "size means"),
}
CURRENT = VERSIONS[ANALYSIS_VERSION]


@dataclass(frozen=True)
class Change:
    version: int
    date: str  # the commit's date (UTC)
    commit: str
    what: str
    data_before: str  # documented runs that existed, already scored, when this version was written
    fingerprint: str = ""  # of the rules as this version left them (pinned from version 4 on)


CHANGELOG = (
    Change(
        1,
        "2026-11-29 20:56",
        "b979709",
        "verdict words from paired 95% t-intervals over seeds: reproduced when the interval lies inside the "
        "claim's region; close/at-most margins set by hand (5%, 2%, ±2%, 1, 1.5 points); ordering claims "
        "had no margin (the interval above or below 0)",
        "none of the runs documented now (the rounds before it were checked on point estimates)",
    ),
    Change(
        2,
        "2026-12-01 07:23",
        "0c64615",
        "one-sided tests at 5% (TOST, non-inferiority, ordering with a smallest effect of half the paper's "
        "gap), Holm within a claim, solve rates with exact intervals on reverse/swap, the test split with "
        "its evaluation error se_A^2 + se_B^2; margins re-derived from the papers by one rule per kind "
        "(5 -> 4.65%, MQA 2 -> 2.47%, ±2 -> ±1.19%, synthetic ±1 -> ±1.66 points, ...)",
        "the 3-seed LM and synthetic round of 2026-11-29 (86bf3b0), scored under version 1; the MQA "
        "verdict moves with this margin revision",
    ),
    Change(
        3,
        "2026-12-01 11:15",
        "00ea725",
        "the fixed test set's variance of a paired difference from per-unit scores (crossed seed x unit "
        "model) instead of se_A^2 + se_B^2",
        "the 16-seed LM runs (runs/lm-decisive) and the 3-seed synthetic runs, trained and scored under "
        "version 2 before this change (published first under version 3, 8178b3c)",
    ),
    Change(
        4,
        "2026-12-02",
        "9d55e53 (issue 27)",
        "claims as the papers made them: worst/best among the variants the paper ran (a labelled qkvlab "
        "ranking over every variant run beside it); one smallest effect per compared pair (half the "
        "paper's own gap of that pair) in every claim; an ordering comparison that holds is reproduced "
        "(an effect smaller than the paper's is reported, not called contradicted); reverse/swap claims "
        "on accuracy, as the paper reports, with a paired exact McNemar test of solve-or-fail over seeds "
        "beside them; the sweep's slope fitted on size means with a lack-of-fit F test, trend words only "
        "where the line fits",
        "every documented result: the sweep of 2026-12-02 re-scored from its committed per-seed rows; lm and "
        "synthetic, whose per-seed scores were not committed, reconstructed from their published intervals "
        "(docs/analysis.md); nothing retrained",
        "6f54bc90e0fea176",
    ),
    Change(
        5,
        "2026-12-03",
        "issue 27, before the 8-seed LM run",
        "one claim added, every other rule as in version 4: Id-K-V matches Q-K-V at equal parameters (Paper A's "
        "size-matched baseline Q-K-V/mlp=Id-K-V), equivalence margin ±1.19% as for Id-K-V vs Q-K-V",
        "none with the size-matched variant: written before the first run that trains it (the 8-seed LM family "
        "of 2026-12-03, docs/results/lm-v5) had started; every older result reads as under version 4 (the "
        "claim needs a variant they did not run)",
        "900ca76ccc9b800c",
    ),
    Change(
        6,
        "2026-12-07",
        "issue 54, before the lm-cache run",
        "eight claims added, every other rule as in version 5, for quality per cache byte from scratch (K=V, GQA/MQA, "
        "the latent and MLA at 50% and 25% of Q-K-V's cache): DeepSeek-V2's MLA above MHA at each budget and MHA > "
        "GQA > MQA (margin 0.35%, half Paper B's GQA-4 +0.7%: DeepSeek-V2 reports accuracy only); MLA beats K=V at "
        "equal cache (1.55%) and GQA beats K=V at half the cache (1.19%), as the papers' figures imply; MLA costs at "
        "most Paper B's bar at each budget (4.65%, 1.05%). A pair with no perplexity in the papers takes its claim's "
        "margin",
        "none with these variants: written before the first run that trains them (docs/results/lm-cache) started; "
        "every older result reads as under version 5 (the claims need variants it did not run)",
        "6d400b6b30ee446f",
    ),
)


def rules(version: int | None = None) -> Rules:
    """The rules of a version (default: the current one); an unknown version is a one-line error."""
    v = ANALYSIS_VERSION if version is None else version
    if v not in VERSIONS:
        known = ", ".join(map(str, VERSIONS))
        raise UserError(f"analysis version {v} cannot be applied to stored scores (versions {known}; 1 is history)")
    return VERSIONS[v]


def change(version: int) -> Change:
    return next(c for c in CHANGELOG if c.version == version)


def fingerprint() -> str:
    """A short hash of everything a verdict depends on besides the data: the claims and margins, the
    constants and the current switches."""
    from qkvlab.analysis.intervals import ALPHA, LEVEL  # startup: scipy; compare imports rules at start

    body = {
        "rules": asdict(CURRENT),
        "constants": [ALPHA, LEVEL, pc.SOLVED_ACCURACY, pc.SESOI_FRACTION, pc.BOUND_FACTOR],
        "claims": [asdict(c) for c in pc.ALL_CLAIMS],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def provenance_lines(scored_with: int, trained_under: int | None) -> list[str]:
    """results.md's statement of the rules and of any rule written after the data."""
    c = change(scored_with)
    lines = [f"- analysis rules: version {scored_with} ({c.date}, {c.commit}; docs/analysis.md, qkvlab.analysis.rules)"]
    if trained_under is None:
        lines.append("- the analysis version these runs were trained under is not recorded")
    elif trained_under < scored_with:
        later = [x for x in CHANGELOG if trained_under < x.version <= scored_with]
        lines.append(
            f"- these runs were trained and first scored under version {trained_under}; rules written after the "
            "data: " + "; ".join(f"v{x.version} ({x.date}): {x.what}" for x in later)
        )
    elif trained_under > scored_with:
        lines.append(f"- re-scored under the older version {scored_with}; the runs were trained under {trained_under}")
    return lines


def changelog_markdown() -> str:
    """docs/analysis.md's table of versions, from CHANGELOG (a test keeps the two equal)."""
    lines = [
        "| version | date (UTC) | commit | what changed | documented data that already existed |",
        "| ---: | --- | --- | --- | --- |",
    ]
    lines += [f"| {c.version} | {c.date} | {c.commit} | {c.what} | {c.data_before} |" for c in CHANGELOG]
    return "\n".join(lines) + "\n"
