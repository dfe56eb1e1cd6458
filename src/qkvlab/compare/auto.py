"""`qkvlab compare --seeds auto [--budget DURATION]`: as many seeds as the decision needs.

A pilot (the recipe's seeds, at least 3; finished runs in the folder are reused) measures each
claim's spread; `analysis.seeds.seeds_for_claims` turns it into the seeds per variant each undecided
claim needs at its margin. The decisive run then trains that fixed n (capped by the budget, at this
machine's measured seconds per run) and reuses the pilot's runs. n is chosen from the pilot alone,
before any decisive data exists, and no run is stopped early on its outcome: the tests' 5% stays
what it says (docs/analysis.md, "Seeds to decide").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from qkvlab.base.units import fmt_duration
from qkvlab.compare.pace import parse_duration

PILOT_SEEDS = 3
MAX_AUTO_SEEDS = 64  # a claim needing more is reported, not run: its gap is too small for this recipe


def choose_seeds(
    needed: dict[str, float], pilot: int, runs_per_seed: int, seconds_per_run: float, budget_s: float | None
) -> tuple[int, str]:
    """(seeds per variant, why): the most any projectable claim needs, within MAX_AUTO_SEEDS and
    the budget (the pilot's seeds are already paid for)."""
    finite = [n for n in needed.values() if n != math.inf and n <= MAX_AUTO_SEEDS]
    too_many = sorted(c for c, n in needed.items() if n == math.inf or n > MAX_AUTO_SEEDS)
    want = max(finite, default=pilot)
    why = f"the claims need {want} seeds" if finite else "no claim the pilot can project needs more"
    if too_many:
        why += f" ({', '.join(too_many)} need more than {MAX_AUTO_SEEDS}: not run)"
    if budget_s is not None and want > pilot:
        affordable = pilot + int(budget_s // max(1e-9, runs_per_seed * seconds_per_run))
        if affordable < want:
            want, why = affordable, f"{why}; the budget buys {affordable}"
    return max(want, pilot), why


def run_auto(plan_fn: Callable, run_fn: Callable, cfg, *, command: str | None, say: Callable[..., None]) -> Any:
    """The pilot, the choice of n, then the decisive plan (which skips the pilot's finished runs)."""
    # startup: scipy; planning imports this module, `compare --help` and --dry-run need none
    from qkvlab.analysis.report import seconds_per_run as seconds_per_run_here
    from qkvlab.analysis.results import collect
    from qkvlab.analysis.seeds import seeds_for_claims

    budget_s = parse_duration(cfg.budget) if cfg.budget is not None else None
    pilot_cfg = dataclasses.replace(cfg, seeds=PILOT_SEEDS)
    pilot = plan_fn(pilot_cfg)
    say(f"compare --seeds auto: pilot of {PILOT_SEEDS} seeds per variant", flush=True)
    outcome = run_fn(pilot, command=command, say=say)
    res = collect(pilot.out)
    runs_per_seed = len(pilot.runs) // PILOT_SEEDS
    seconds_per_run = seconds_per_run_here(res) or 60.0
    needed = seeds_for_claims(res.verdicts())
    n, why = choose_seeds(needed, PILOT_SEEDS, runs_per_seed, seconds_per_run, budget_s)
    cost = (n - PILOT_SEEDS) * runs_per_seed * seconds_per_run
    say(f"compare --seeds auto: {n} seeds per variant ({why}); about {fmt_duration(cost)} more here", flush=True)
    if n == PILOT_SEEDS:
        return outcome
    return run_fn(plan_fn(dataclasses.replace(cfg, seeds=n)), command=command, say=say)
