"""Results -> results.md (tables beside the papers' figures, which orderings the runs reproduced),
results.csv (results_csv.py) and the plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from qkvlab.analysis import paper_claims as pc
from qkvlab.analysis import paper_figures as pf
from qkvlab.analysis.intervals import Interval
from qkvlab.analysis.results import Results, collect
from qkvlab.analysis.results_csv import to_csv
from qkvlab.analysis.rules import provenance_lines, rules
from qkvlab.analysis.runs import write_manifest, write_scores
from qkvlab.analysis.trends import trends_markdown
from qkvlab.analysis.verdict_table import format_gap, verdicts_markdown
from qkvlab.analysis.verdicts import check
from qkvlab.base.files import atomic_write
from qkvlab.base.units import EMPTY, human
from qkvlab.model.accounting import analytic_params
from qkvlab.model.config import preset
from qkvlab.model.variants import BASELINE, parse_variant


def _pm(ms: tuple[float, float] | None, fmt: str = "{:.4f}", n: int = 1) -> str:
    if ms is None:
        return EMPTY
    m, s = ms
    return fmt.format(m) + (" ± " + fmt.format(s).lstrip("+") if n > 1 else "")


def _pct(x: float | None) -> str:
    if x is None:
        return EMPTY
    return f"{100 * x:.1f}%" if x >= 0.1 else f"{100 * x:.2g}%"


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def lm_table(res: Results, task: str) -> str:
    rows = [r for r in res.rows if r.task == task]
    header = [
        "variant",
        "params",
        "non-emb. params",
        "KV cache B/token (bf16)",
        "KV vs Q-K-V",
        "loss",
        "ppl vs Q-K-V (95% CI)",
        "tokens/s",
        "seeds",
        "paper: ppl vs Q-K-V",
        "paper: KV vs Q-K-V",
    ]
    body = []
    gaps = res.gaps()
    for r in rows:
        gap, pp, pk = gaps.get((task, r.variant)), r.paper_ppl_change, r.paper_kv_fraction
        body.append(
            [
                f"`{r.variant}`",
                human(r.params.total, spec=".3g"),
                human(r.params.non_embedding, spec=".3g"),
                f"{r.kv_bytes:,}",
                _pct(r.kv_fraction),
                _pm(r.metric_mean_std, n=r.n),  # the scored loss (the lm metric is the loss)
                "reference" if r.variant == BASELINE else gap_cell(gap, "%"),
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "–",
                f"{r.n}/{r.planned}",
                str(pp) if pp else "–",
                _pct(pk),
            ]
        )
    return _md_table(header, body)


def family_table(res: Results, tasks: Sequence[str]) -> str:
    variants = [v for v in res.variants if any(res.row(t, v) for t in tasks)]
    metric = next(r.metric for r in res.rows if r.task in tasks)
    header = ["variant", "params"] + [f"{t} {metric}" for t in tasks] + ["mean", "paper mean"]
    body = []
    for v in variants:
        cells, means, paper = [], [], []
        first = next(res.row(t, v) for t in tasks if res.row(t, v))
        for t in tasks:
            r = res.row(t, v)
            if r is None:
                cells.append("–")
                continue
            means.append(r.metric_mean_std[0])
            pv = r.paper_metric
            paper.append(pv)
            cells.append(_pm(r.metric_mean_std, "{:.3f}", r.n) + (f" ({pv:.3f})" if pv is not None else ""))
        mean = f"{sum(means) / len(means):.3f}" if len(means) == len(tasks) else "–"
        paper_mean = (
            f"{sum(paper) / len(paper):.3f}"
            if paper and all(p is not None for p in paper) and len(paper) == len(tasks)
            else "–"
        )
        body.append([f"`{v}`", human(first.params.total, spec=".3g")] + cells + [mean, paper_mean])
    return _md_table(header, body)


def paper_a_params_table() -> str:
    """Our analytic counts at Paper A's GPT-2 small config against the paper's figures."""
    base = preset("gpt2-124m")
    body = []
    for name, paper in pf.PAPER_A_NON_EMBEDDING_M.items():
        ours = analytic_params(parse_variant(name).apply(base)).non_embedding / 1e6
        body.append([f"`{name}`", f"{ours:.2f}M", f"{paper:.2f}M", "yes" if abs(ours - paper) < 0.005 else "no"])
    return _md_table(["variant", "qkvlab (analytic)", "Paper A", "match"], body, "lrrl")


def gap_cell(iv: Interval | None, unit: str) -> str:
    """'+13.01% [+8.20, +17.95]'; one seed: '+13.01% (1 seed)', or with the test split's error
    '+13.01% [+12.90, +13.12] (1 seed: evaluation error only)'."""
    if iv is None:
        return "–"
    u = "%" if unit == "%" else f" {unit}"
    digits = 2 if unit == "%" else 1
    head = f"{iv.estimate:+.{digits}f}{u}"
    if not iv.defined:
        return head + " (1 seed)"
    return (
        head
        + f" [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}]"
        + (" (1 seed: evaluation error only)" if iv.n == 1 else "")
    )


def trends_section(res: Results) -> str:
    rows = res.trends()
    return trends_markdown(rows, res.gaps())


def _run_section(res: Results) -> str:
    m = res.manifest
    lines = []
    if m.get("command"):
        lines.append(f"- command: `{m['command']}`")
    tr = m.get("train", {})
    if tr:
        keys = ("preset", "max_steps", "batch_size", "lr", "warmup_steps", "eval_every", "eval_batches", "dtype")
        lines.append("- training: " + ", ".join(f"{k} {tr[k]}" for k in keys if k in tr))
    model = res.runs[0].cfg.to_dict() if res.runs else m.get("model", {})  # as trained (vocab fitted to data)
    if model:
        keys = ("n_layer", "n_head", "d_model", "mlp_hidden", "context", "vocab_size", "norm", "pos", "mlp")
        lines.append("- base model: " + ", ".join(f"{k} {model[k]}" for k in keys if model.get(k) is not None))
    if m.get("task_options"):
        lines.append(f"- task options: {json.dumps(m['task_options'])}")
    if m.get("grid"):
        lines.append(
            f"- grid: {len(m['grid'])} point(s): "
            + "; ".join(g.get("label", "default") for g in m["grid"][:6])
            + (" ..." if len(m["grid"]) > 6 else "")
        )
    seeds = f"seeds: {', '.join(map(str, m['seeds']))}; " if m.get("seeds") else ""
    lines.append(
        f"- {seeds}runs finished {len(res.runs)} of {len(m.get('runs', []))}"
        + (f" (not finished: {len(res.missing)})" if res.missing else "")
    )
    t = m.get("timing", {})
    if t:
        lines.append(
            f"- wall time: {t.get('wall_s', 0):.0f} s this invocation ({t.get('trained', 0)} runs trained, "
            f"{t.get('skipped', 0)} already finished and skipped); training-step time summed over all runs "
            f"{t.get('train_s_total', 0):.0f} s"
        )
    mach = m.get("machine", {})
    if mach:
        lines.append("- machine: " + ", ".join(f"{k} {v}" for k, v in mach.items()))
    lines += provenance_lines(res.rules.version, m.get("trained_under_analysis"))
    if res.from_scores:
        lines.append("- re-derived from scores.json (every run's stored scores); the run folders are not on disk")
    return "\n".join(lines) + "\n"


def seconds_per_run(res: Results) -> float | None:
    """Wall seconds one run took here with the machine's parallel jobs: the last invocation's wall
    time over the runs it trained, else the runs' own training time over the jobs."""
    m = res.manifest
    t = m.get("timing") or {}
    if t.get("trained") and t.get("wall_s"):
        return float(t["wall_s"]) / int(t["trained"])
    own = [float(r.final.get("elapsed_s") or 0) for r in res.runs]
    jobs = int((m.get("machine") or {}).get("jobs") or 1)
    return sum(own) / len(own) / jobs if own and sum(own) > 0 else None


def claims_section(res: Results, seconds: float | None = None) -> str:
    """The verdict table with its 'seeds to decide' column and the commands that decide."""
    m = res.manifest
    seeds = len(m.get("seeds") or []) or max((r.planned for r in res.rows), default=1)
    runs_per_seed = max(1, len(m.get("runs") or res.runs) // max(1, seeds))
    return verdicts_markdown(
        res.verdicts(),
        runs_per_seed=runs_per_seed,
        seconds_per_run=seconds if seconds is not None else seconds_per_run(res),
        command=m.get("command") or "",
    )


def claims_note(res: Results) -> str:
    """What the verdict words mean under the rules the table was scored with."""
    r = res.rules
    ordering = (
        "an ordering that holds is reproduced even when its effect is excluded from the paper's size (marked "
        "'smaller than the paper's effect')"
        if r.overlap == "holds"
        else "an ordering claim also when the effect is smaller than its margin"
    )
    solve = (
        "Solve-or-fail tasks (reverse, swap): the paper's accuracy claim by paired t, and a solve-or-fail claim "
        "by McNemar's exact test over seeds."
        if r.solve == "mcnemar"
        else "Solve-or-fail tasks (reverse, swap) compare solve rates with exact intervals."
    )
    among = "the variants the paper ran" if r.among == "paper" else "every variant run"
    return (
        "Each gap is paired by seed (and grid point); its standard error holds the spread of the per-seed "
        "differences and the evaluation's own error (test split). `reproduced`: every comparison of the claim "
        "passes its one-sided test(s) at 5%; `contradicted`: Holm's rule over the comparisons rejects the claim "
        f"at 5% ({ordering}); `inconclusive` otherwise and always with one seed. Worst/best rank among {among}. "
        f"{solve} Margins come from the papers by one rule per kind (analysis version {r.version}; their history "
        "and the seeds-to-decide rule: docs/analysis.md)."
    )


def ranking_section(res: Results) -> list[str]:
    """qkvlab's own ranking over every variant run (no paper made it): per task with three or more
    variants, the one with the worst mean and whether it is worse than each of the others (paired
    one-sided tests at 5%, no margin; Holm over them)."""
    vals, hib, metric = res.values(), res.higher_is_better, res.metric
    rules = replace(res.rules, among="run", margins="per claim")
    lines = []
    for task, by_variant in vals.items():
        if len(by_variant) < 3 or task in pc.SOLVE_OR_FAIL_TASKS and res.rules.solve == "newcombe":
            continue
        mean = lambda v: sum(getattr(x, "value", x) for x in by_variant[v].values()) / len(by_variant[v])
        order = sorted(by_variant, key=mean, reverse=hib.get(task, True))  # best first
        claim = pc.Claim(f"qkvlab-worst-{task}", "qkvlab", f"{order[-1]} is the worst", "worst", (task,), (order[-1],))
        v = check(claim, vals, hib, metric, rules=rules)
        if v.word is None:
            continue
        closest = v.decisive
        lines.append(
            f"| {task} | {' < '.join(f'`{x}`' for x in order)} | `{order[-1]}` worse than each of the "
            f"{len(v.gaps)} others: **{'yes' if v.word == 'reproduced' else 'not shown'}** | {format_gap(closest)} |"
        )
    if not lines:
        return []
    head = [
        "## qkvlab ranking (every variant run; not a claim of either paper)",
        "",
        "| task | best → worst by mean | worst of all, paired one-sided tests at 5%, Holm, no margin | "
        "closest comparison (90% CI) |",
        "| --- | --- | --- | --- |",
    ]
    return head + lines + [""]


def to_markdown(res: Results, plots: Sequence[str] = (), seconds: float | None = None) -> str:
    m = res.manifest
    title = m.get("task_label") or ", ".join(res.tasks)
    out = [f"# qkvlab compare: {title}", ""]
    if not res.rows:
        out += ["No run has finished yet.", ""]
    lm_tasks = [t for t in res.tasks if all(r.metric == "val_loss" for r in res.rows if r.task == t)]
    other = [t for t in res.tasks if t not in lm_tasks]
    sources = res.sources()
    for t in lm_tasks:
        out += [
            f"## {t}: loss and perplexity ({sources.get(t, 'validation')})",
            "",
            lm_table(res, t),
            "",
            "Loss: mean ± sample std over seeds. Perplexity change: exp(mean over seeds of loss − loss of Q-K-V "
            "of the same seed) − 1, with a paired 95% t-interval (plus the evaluation's own error on the test split). "
            "KV cache: bytes per token over all layers in bf16 (the distinct key/value tensors). "
            "Paper columns: Paper B 300M (SlimPajama, 10B tokens) and Paper A GPT-2 124M (OpenWebText); "
            "KV vs Q-K-V of the paper is for its 16-head model (GQA-g keeps g of 16 heads).",
            "",
        ]
    if other:
        metric = res.rows[[r.task for r in res.rows].index(other[0])].metric
        out += [
            f"## {metric} per task ({'; '.join(dict.fromkeys(f'{t}: {sources.get(t, chr(45))}' for t in other))})"
            if len({sources.get(t) for t in other}) > 1
            else f"## {metric} per task ({sources.get(other[0], 'validation')})",
            "",
            family_table(res, other),
            "",
            "Mean ± sample std over seeds (and grid points); in parentheses Paper B's Table 1/2 figure where it "
            "reports one (mnist5k is compared with the paper's MNIST). Paper's grid and data are larger.",
            "",
        ]
    out += [
        "## The papers' claims",
        "",
        claims_section(res, seconds),
        claims_note(res),
        "",
        *ranking_section(res),
        "## Gap to Q-K-V over training",
        "",
        trends_section(res),
        "Trend: least-squares slope of the seed-mean gap over the last half of training with its 95% interval; "
        "`flat` when it contains 0, else `shrinking` (toward 0) or `growing`.",
        "",
    ]
    if "lm" in res.tasks:
        out += ["## Paper A's parameter counts at GPT-2 small (analytic, no training)", "", paper_a_params_table(), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    out += ["## Run", "", _run_section(res)]
    return "\n".join(out)


def write_results(
    out_dir: str | Path,
    res: Results | None = None,
    *,
    plots: bool = True,
    seconds_per_run: float | None = None,
    analysis_version: int | None = None,
) -> Results:
    """Collect (unless given) and write results.md, results.csv, the plots and, from run folders,
    scores.json (what a later --render re-derives all of it from) into out_dir, scored under the
    analysis rules of analysis_version (default: the current one); compare.json records the version.
    seconds_per_run: wall seconds per run here (parallel jobs included) for the 'seeds to decide'
    cost; default: the folder's own timing."""
    out_dir = Path(out_dir)
    res = res or collect(out_dir, rules(analysis_version))
    res.manifest["analysis_version"] = res.rules.version
    write_manifest(out_dir, res.manifest)
    if res.runs and not res.from_scores:
        write_scores(out_dir, res.runs, res.manifest)
    written: list[Path] = []
    if plots and res.rows:
        from qkvlab.analysis.plots import write_plots  # startup: matplotlib, when plots are drawn

        written = write_plots(res, out_dir)
    atomic_write(out_dir / "results.csv", to_csv(res))
    atomic_write(out_dir / "results.md", to_markdown(res, [str(p) for p in written], seconds_per_run))
    return res
