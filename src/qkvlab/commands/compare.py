"""Train every attention variant on a task (or a task family) over seeds; write a results table
beside the papers' figures, CSV and plots.

With no arguments: Q-K-V, Id-K-V, Id-K-V/mlp, Q-K=V, Q=K-V, Q=V-K, Q=K=V, Id-K=V and Q-K=V/MQA on
the Shakespeare corpus, 3 seeds each, at a CPU-sized model (27 runs, minutes on 2 cores).
`--task synthetic|vision|anomaly|segmentation` (or one task, e.g. `reverse`) runs Paper B's six
schemes (the '+' forms included) over a small grid; `--full-grid` runs the paper's grid.

Variants: SCHEME[/MQA|/GQA-g][/mlp[=SCHEME]|/width=SCHEME], comma-separated, e.g.
`--variants Q-K-V,Q-K=V/MQA,Id-K-V/mlp,Q-K-V/width=Id-K-V` (`/mlp`: MLP widened to Q-K-V's
parameter count; `/width=S`: d_model shrunk to S's; '+' stays the 2D score term, as in `(Q=K-V)+`).

`--render --out DIR` trains nothing: it re-derives DIR's results from its stored scores under the
analysis rules (`--analysis-version N` for an older version's, docs/analysis.md).

`--sweep` trains the LM variants at several model sizes (`--sizes`, tokens proportional to
parameters, `--tokens-per-param`) into OUT/<size>/<variant>/seed<k> and writes each variant's gap
to Q-K-V per size with intervals and its slope in log N (nothing predicted beyond 10x the largest size).

Runs go to OUT/<task>/<variant>/seed<k> (OUT/<task>/<grid point>/... on a grid); a finished run
(final model + metrics) is skipped when compare runs again, an interrupted one resumes. On CPU the
runs train in parallel, one thread each (`--jobs`). On GPUs, one run at a time over every rank:
`torchrun --nproc_per_node 8 -m qkvlab compare --preset paperB-300m --data PATH --seeds 1`.
The library behind it: qkvlab.compare (plan, run).
"""

from __future__ import annotations

import sys

from qkvlab.base.errors import UserError
from qkvlab.base.settings import add_config_options, add_options, load, print_config
from qkvlab.compare import CompareConfig, plan
from qkvlab.compare import run as run_plan
from qkvlab.compare.auto import run_auto
from qkvlab.compare.execute import preflight
from qkvlab.compare.render import render


def add_arguments(p) -> None:
    add_config_options(p, "compare settings")
    add_options(p, CompareConfig)


def run(args) -> int:
    cfg = load(CompareConfig, args.config, args)
    if print_config(args, cfg.to_dict()):
        return 0
    if cfg.render:  # stored scores only: no plan, nothing trained
        if not cfg.out:
            raise UserError("--render needs --out FOLDER (the compare folder to re-derive)")
        render(cfg.out, cfg.analysis_version, plots=cfg.plots)
        return 0
    if cfg.analysis_version is not None:
        raise UserError("--analysis-version goes with --render (a run is scored under the current rules)")
    p = plan(cfg)
    if cfg.dry_run:
        preflight(p)
        for line in p.describe():
            print(line)
        return 0
    command = "qkvlab " + " ".join(sys.argv[1:]) if "compare" in sys.argv[1:] else None
    if cfg.seeds == "auto":
        outcome = run_auto(plan, run_plan, cfg, command=command, say=print)
    else:
        outcome = run_plan(p, command=command)
    if outcome.failures:
        print(f"qkvlab compare: {len(outcome.failures)} run(s) diverged, first: {outcome.failures[0]}", file=sys.stderr)
        return 3
    return 0
