"""Compare attention variants: plan the runs from a `CompareConfig`, train them, tabulate.

    from qkvlab.compare import CompareConfig, plan, run
    p = plan(CompareConfig(task="reverse", variants="Q-K-V,Q-K=V", seeds=1, max_steps=50))
    outcome = run(p)          # trains what is not finished; writes results.md/.csv and plots
    outcome.results.rows      # one row per (task, variant)

The command `qkvlab compare` is this, with the settings read from the command line or --config.
"""

from qkvlab.compare.execute import run
from qkvlab.compare.planning import CompareConfig, Plan
from qkvlab.compare.planning import plan as plan_grid
from qkvlab.compare.sweep import plan_sweep


def plan(cfg: CompareConfig) -> Plan:
    """Every run of the comparison (nothing is trained or written): the scaling sweep's with
    --sweep (compare/sweep.py), else the task grid's (compare/planning.py)."""
    return plan_sweep(cfg.validate()) if cfg.sweep else plan_grid(cfg)


__all__ = ["CompareConfig", "plan", "run"]  # the Python API docs/guide.md shows; every other name from its module
