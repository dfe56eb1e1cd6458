"""Compare attention variants: plan the runs from a `CompareConfig`, train them, tabulate.

    from qkvlab.compare import CompareConfig, plan, run
    p = plan(CompareConfig(task="reverse", variants="Q-K-V,Q-K=V", seeds=1, max_steps=50))
    outcome = run(p)          # trains what is not finished; writes results.md/.csv and plots
    outcome.results.rows      # one row per (task, variant)

The command `qkvlab compare` is this, with the settings read from the command line or --config.
"""

from qkvlab.compare.execute import Outcome, run
from qkvlab.compare.planning import CompareConfig, Plan, PlannedRun, plan, run_state

__all__ = ["CompareConfig", "Outcome", "Plan", "PlannedRun", "plan", "run", "run_state"]
