"""Train every attention variant on a task (or a task family) over seeds; write a results table
beside the papers' figures, CSV and plots.

With no arguments: Q-K-V, Id-K-V, Id-K-V/mlp, Q-K=V, Q=K-V, Q=K=V, Id-K=V and Q-K=V/MQA on the
Shakespeare corpus, 3 seeds each, at a CPU-sized model (24 runs, minutes on 2 cores).
`--task synthetic|vision|anomaly|segmentation` (or one task, e.g. `reverse`) runs Paper B's six
schemes (the '+' forms included) over a small grid; `--full-grid` runs the paper's grid.

Variants: SCHEME[/MQA|/GQA-g][/mlp[=SCHEME]|/width=SCHEME], comma-separated, e.g.
`--variants Q-K-V,Q-K=V/MQA,Id-K-V/mlp,Q-K-V/width=Id-K-V` (`/mlp`: MLP widened to Q-K-V's
parameter count; `/width=S`: d_model shrunk to S's; '+' stays the 2D score term, as in `(Q=K-V)+`).

`--sweep` trains the LM variants at several model sizes (`--sizes`, tokens proportional to
parameters, `--tokens-per-param`) into OUT/<size>/<variant>/seed<k> and writes each variant's gap
to Q-K-V against size and compute, a fitted trend and its extrapolation to the papers' sizes.

Runs go to OUT/<task>/<variant>/seed<k> (OUT/<task>/<grid point>/... on a grid); a finished run
(final model + metrics) is skipped when compare runs again, an interrupted one resumes. On CPU the
runs train in parallel, one thread each (`--jobs`). On GPUs, one run at a time over every rank:
`torchrun --nproc_per_node 8 -m qkvlab compare --preset paperB-300m --data PATH --seeds 1`.
The library behind it: qkvlab.compare (plan, run).
"""

from __future__ import annotations

import sys

from qkvlab.cli import add_config_options, add_model_options, model_overrides, print_config
from qkvlab.compare import CompareConfig, plan
from qkvlab.compare import run as run_plan
from qkvlab.errors import UserError
from qkvlab.settings import add_options, options_from_args, parse_key_values


def add_arguments(p) -> None:
    add_config_options(p, "compare settings")
    add_options(p, CompareConfig)
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a task option (repeatable; VALUE read as YAML), e.g. length=64, root=/data/cifar10",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, train nothing")
    add_model_options(p, with_preset_default=False)


def config_from_args(args) -> CompareConfig:
    """--config FILE, then the command line over it."""
    from qkvlab.train.config import read_config_file

    body = read_config_file(args.config) if args.config else {}
    names = {f for f in CompareConfig.__dataclass_fields__}
    unknown = sorted(set(body) - names)
    if unknown:
        raise UserError(f"{args.config}: unknown compare setting {unknown[0]!r}; allowed: {', '.join(sorted(names))}")
    body.update(options_from_args(args, CompareConfig))
    if args.preset is not None:
        body["preset"] = args.preset
    body["task_options"] = {**body.get("task_options", {}), **parse_key_values(args.task_option)}
    body["model"] = {**body.get("model", {}), **model_overrides(args)}
    try:
        return CompareConfig(**body).validate()
    except TypeError as e:
        raise UserError(f"bad compare settings: {e}") from None


def run(args) -> int:
    cfg = config_from_args(args)
    if print_config(args, cfg.to_dict()):
        return 0
    p = plan(cfg)
    if args.dry_run:
        for line in p.describe():
            print(line)
        return 0
    command = "qkvlab " + " ".join(sys.argv[1:]) if "compare" in sys.argv[1:] else None
    if cfg.seeds == "auto":
        from qkvlab.compare.auto import run_auto

        outcome = run_auto(plan, run_plan, cfg, command=command, say=print)
    else:
        outcome = run_plan(p, command=command)
    if outcome.failures:
        print(f"qkvlab compare: {len(outcome.failures)} run(s) diverged, first: {outcome.failures[0]}", file=sys.stderr)
        return 3
    return 0
