"""Finished runs -> per-variant results: a markdown table beside the papers' figures, a CSV, and
which of the papers' orderings the runs reproduced.

Variant notation (what `qkvlab compare --variants` reads): ``SCHEME[/OPTION...]``.
SCHEME is a projection scheme (``Q-K-V``, ``Id-K-V``, ``Q-K=V``, ``(Q=K-V)+`` ...); options:

- ``MQA``: one key/value head; ``GQA-g`` (or ``GQAg``): g key/value heads;
- ``mlp``: MLP widened so the parameter count equals Q-K-V's (Paper A's identity_larger_mlp);
  ``mlp=SCHEME`` matches another scheme.

e.g. ``Id-K-V/mlp``, ``Q-K=V/MQA``, ``Q-K=V/GQA-4``. ``/`` rather than the paper's "Q-K=V+MQA",
because ``+`` already means the 2D positional score term. A list is comma-separated.

A compare folder holds ``compare.json`` (the plan: tasks, variants, seeds, run folders, timing,
machine) and one run folder per (task, variant, seed), each written by the train loop
(``metrics.jsonl``, ``config.json`` whose ``train.finished`` is true, ``model.safetensors``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkvlab.accounting import analytic_params, kv_cache_bytes_per_token
from qkvlab.analysis import paper_figures as pf
from qkvlab.config import ModelConfig
from qkvlab.errors import UserError
from qkvlab.spec import parse_scheme

MANIFEST = "compare.json"
BASELINE = "Q-K-V"
CACHE_DTYPE = "bf16"  # the papers' training dtype; the cache column's unit

# ---- variants ---------------------------------------------------------------------------------
_GQA = re.compile(r"^GQA-?(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Variant:
    """A scheme plus the options compare varies: key/value heads and a parameter-matched MLP."""

    scheme: str  # canonical, e.g. "Q-K=V"
    kv_heads: int | None = None  # None: as many as query heads (MHA); 1: MQA; g: GQA-g
    match: str | None = None  # match_params scheme (MLP re-spends saved params)

    @property
    def name(self) -> str:
        out = self.scheme
        if self.kv_heads is not None:
            out += "/MQA" if self.kv_heads == 1 else f"/GQA-{self.kv_heads}"
        if self.match is not None:
            out += "/mlp" if self.match == BASELINE else f"/mlp={self.match}"
        return out

    @property
    def slug(self) -> str:
        """A folder name without shell-special characters: Q-K=V/MQA -> Q-K=V_MQA."""
        return self.name.replace("(", "").replace(")", "").replace("+", "plus").replace("/", "_")

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """The variant's model config on top of a base config (validated: one-line errors)."""
        try:
            return cfg.replace(attn=self.scheme, kv_heads=self.kv_heads, match_params=self.match).validate()
        except UserError as e:
            raise UserError(f"variant {self.name}: {e}") from None

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Variant:
        kv = cfg.kv_heads if cfg.kv_heads not in (None, cfg.n_head) else None
        match = parse_scheme(cfg.match_params).name if cfg.match_params else None
        return cls(cfg.spec.name, kv, match)


def parse_variant(text: str) -> Variant:
    parts = [p.strip() for p in text.strip().split("/")]
    if not parts[0]:
        raise UserError(f"variant {text!r} is empty; write SCHEME[/MQA|/GQA-g][/mlp], e.g. Q-K=V/MQA")
    try:
        scheme = parse_scheme(parts[0]).name
    except UserError as e:
        raise UserError(f"variant {text!r}: {e}") from None
    kv, match = None, None
    for opt in parts[1:]:
        gqa = _GQA.match(opt)
        if opt.upper() == "MQA" and kv is None:
            kv = 1
        elif gqa and kv is None and int(gqa.group(1)) > 0:
            kv = int(gqa.group(1))
        elif opt.lower() == "mlp" and match is None:
            match = BASELINE
        elif opt.lower().startswith("mlp=") and match is None:
            try:
                match = parse_scheme(opt[4:]).name
            except UserError as e:
                raise UserError(f"variant {text!r}: {e}") from None
        else:
            raise UserError(
                f"variant {text!r}: option {opt!r} is not one of MQA, GQA-g, mlp, mlp=SCHEME "
                "(each at most once), e.g. Q-K=V/MQA or Id-K-V/mlp"
            )
    return Variant(scheme, kv, match)


def parse_variants(text: str | Sequence[str]) -> list[Variant]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[Variant] = []
    for item in items:
        if item.strip():
            v = parse_variant(item)
            if v not in out:
                out.append(v)
    if not out:
        raise UserError(f"--variants {text!r} names no variant; e.g. Q-K-V,Id-K-V/mlp,Q-K=V/MQA")
    return out


# ---- runs -------------------------------------------------------------------------------------
METRICS, CONFIG, WEIGHTS = "metrics.jsonl", "config.json", "model.safetensors"


def run_finished(run_dir: str | Path) -> bool:
    """A run is finished when its final model and metrics exist (config.json says finished)."""
    d = Path(run_dir)
    if not ((d / WEIGHTS).is_file() and (d / METRICS).is_file() and (d / CONFIG).is_file()):
        return False
    try:
        body = json.loads((d / CONFIG).read_text())
        return bool(body.get("finished") or (body.get("train") or {}).get("finished"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    rows = []
    path = Path(run_dir) / METRICS
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{n}: not a JSON line") from None
    if not rows:
        raise UserError(f"{path}: no metrics rows")
    return rows


@dataclass
class Run:
    task: str
    variant: str
    seed: int
    dir: Path
    cfg: ModelConfig
    history: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]

    @property
    def tokens_per_s(self) -> float | None:
        vals = [r["tokens_per_s"] for r in self.history if r.get("step", 0) > 0 and r.get("tokens_per_s")]
        return sum(vals) / len(vals) if vals else None

    def curve(self, key: str = "val_loss") -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]


def load_run(task: str, variant: str, seed: int, run_dir: str | Path) -> Run:
    from qkvlab.io import read_config

    cfg, _ = read_config(run_dir)
    return Run(task, variant, seed, Path(run_dir), cfg, read_history(run_dir))


# ---- manifest ---------------------------------------------------------------------------------
def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path}: no such file (a compare folder is written by `qkvlab compare`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg})") from None


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> None:
    from qkvlab.io import atomic_write_text

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2) + "\n")


# ---- aggregation ------------------------------------------------------------------------------
def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    n = len(xs)
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0)


@dataclass
class Row:
    """One (task, variant) line of the results."""

    task: str
    variant: str
    metric: str
    higher_is_better: bool
    seeds: list[int]
    planned: int
    cfg: ModelConfig
    metric_values: list[float]
    val_losses: list[float]
    tokens_per_s: float | None
    steps: int
    ppl_change: list[float] = field(default_factory=list)  # % vs Q-K-V, paired by seed

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def metric_mean_std(self) -> tuple[float, float]:
        return mean_std(self.metric_values)

    @property
    def val_loss_mean_std(self) -> tuple[float, float]:
        return mean_std(self.val_losses)

    @property
    def ppl_change_mean_std(self) -> tuple[float, float] | None:
        return mean_std(self.ppl_change) if self.ppl_change else None

    @property
    def params(self):
        return analytic_params(self.cfg)

    @property
    def causal(self) -> bool:
        return self.cfg.causal

    @property
    def kv_bytes(self) -> int:
        return kv_cache_bytes_per_token(self.cfg, CACHE_DTYPE)

    @property
    def kv_fraction(self) -> float:
        base = self.cfg.replace(attn=BASELINE, kv_heads=None, match_params=None)
        return self.kv_bytes / kv_cache_bytes_per_token(base, CACHE_DTYPE)

    @property
    def paper_metric(self) -> float | None:
        return pf.task_metric(self.task, self.variant)

    @property
    def paper_ppl_change(self) -> pf.PaperValue | None:
        return pf.lm_ppl_change(self.variant) if self.task == "lm" else None

    @property
    def paper_kv_fraction(self) -> float | None:
        return pf.PAPER_B_LM_CACHE_FRACTION.get(self.variant) if self.task == "lm" else None


@dataclass
class Results:
    rows: list[Row]
    runs: list[Run]
    manifest: dict[str, Any]
    missing: list[tuple[str, str, int]]  # planned runs that have not finished

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r.task for r in self.rows))

    @property
    def variants(self) -> list[str]:
        return list(dict.fromkeys(r.variant for r in self.rows))

    def row(self, task: str, variant: str) -> Row | None:
        return next((r for r in self.rows if r.task == task and r.variant == variant), None)

    def table(self) -> pf.Table:
        cells: dict[str, dict[str, pf.Stat]] = {}
        for r in self.rows:
            m, s = r.metric_mean_std
            cells.setdefault(r.task, {})[r.variant] = pf.Stat(m, s, r.n)
        return pf.Table(cells, {r.task: r.higher_is_better for r in self.rows})

    def verdicts(self) -> list[pf.Verdict]:
        return pf.check_claims(self.table())


def _metric_of(run: Run, declared: str | None) -> str:
    if declared:
        return declared
    standard = {"step", "tokens", "train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "elapsed_s"}
    extra = [k for k in run.final if k not in standard and isinstance(run.final[k], (int, float))]
    return extra[0] if extra else "val_loss"


def collect(out_dir: str | Path) -> Results:
    """Read a compare folder: every finished run of the manifest, aggregated per (task, variant)."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    runs: list[Run] = []
    missing: list[tuple[str, str, int]] = []
    planned: dict[tuple[str, str], int] = {}
    declared: dict[str, tuple[str, bool]] = {
        t: (v["metric"], v["higher_is_better"]) for t, v in manifest.get("metrics", {}).items()
    }
    for entry in manifest["runs"]:
        key = (entry["task"], entry["variant"])
        planned[key] = planned.get(key, 0) + 1
        run_dir = out_dir / entry["dir"]
        if run_finished(run_dir):
            runs.append(load_run(entry["task"], entry["variant"], int(entry["seed"]), run_dir))
        else:
            missing.append((entry["task"], entry["variant"], int(entry["seed"])))

    rows: list[Row] = []
    for (task, variant), n_planned in planned.items():
        group = [r for r in runs if r.task == task and r.variant == variant]
        if not group:
            continue
        metric, hib = declared.get(task, (_metric_of(group[0], None), False))
        if task not in declared and metric != "val_loss":
            hib = True  # accuracies and IoUs
        tps = [t for t in (r.tokens_per_s for r in group) if t is not None]
        rows.append(
            Row(
                task=task,
                variant=variant,
                metric=metric,
                higher_is_better=hib,
                seeds=[r.seed for r in group],
                planned=n_planned,
                cfg=group[0].cfg,
                metric_values=[float(r.final[metric]) for r in group],
                val_losses=[float(r.final["val_loss"]) for r in group],
                tokens_per_s=sum(tps) / len(tps) if tps else None,
                steps=max(int(r.final["step"]) for r in group),
            )
        )
    # Perplexity change vs Q-K-V, paired by seed (same data order and init seed: less noise).
    for row in rows:
        base = next((b for b in rows if b.task == row.task and b.variant == BASELINE), None)
        if base is None or row.metric != "val_loss":
            continue
        base_loss = dict(zip(base.seeds, base.val_losses))
        row.ppl_change = [
            100.0 * math.expm1(loss - base_loss[s]) for s, loss in zip(row.seeds, row.val_losses) if s in base_loss
        ]
    return Results(rows, runs, manifest, missing)


# ---- writing ----------------------------------------------------------------------------------
CSV_COLUMNS = (
    "task",
    "variant",
    "scheme",
    "kv_heads",
    "mlp_hidden",
    "params_total",
    "params_non_embedding",
    "kv_cache_bytes_per_token",
    "kv_cache_fraction",
    "metric",
    "metric_mean",
    "metric_std",
    "val_loss_mean",
    "val_loss_std",
    "ppl_change_pct_mean",
    "ppl_change_pct_std",
    "tokens_per_s",
    "steps",
    "seeds",
    "seeds_planned",
    "paper_metric",
    "paper_ppl_change_pct",
    "paper_kv_cache_fraction",
)


def csv_rows(res: Results) -> list[dict[str, Any]]:
    out = []
    for r in res.rows:
        m, s = r.metric_mean_std
        lm, ls = r.val_loss_mean_std
        pc = r.ppl_change_mean_std
        pp = r.paper_ppl_change
        out.append(
            {
                "task": r.task,
                "variant": r.variant,
                "scheme": r.cfg.spec.name,
                "kv_heads": r.cfg.n_kv_heads,
                "mlp_hidden": r.cfg.hidden,
                "params_total": r.params.total,
                "params_non_embedding": r.params.non_embedding,
                "kv_cache_bytes_per_token": r.kv_bytes if r.causal else "",
                "kv_cache_fraction": round(r.kv_fraction, 6) if r.causal else "",
                "metric": r.metric,
                "metric_mean": m,
                "metric_std": s,
                "val_loss_mean": lm,
                "val_loss_std": ls,
                "ppl_change_pct_mean": pc[0] if pc else "",
                "ppl_change_pct_std": pc[1] if pc else "",
                "tokens_per_s": round(r.tokens_per_s, 1) if r.tokens_per_s else "",
                "steps": r.steps,
                "seeds": r.n,
                "seeds_planned": r.planned,
                "paper_metric": r.paper_metric if r.paper_metric is not None else "",
                "paper_ppl_change_pct": pp.value if pp else "",
                "paper_kv_cache_fraction": r.paper_kv_fraction if r.paper_kv_fraction is not None else "",
            }
        )
    return out


def to_csv(res: Results) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(csv_rows(res))
    return buf.getvalue()


def _human(n: float) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def _pm(ms: tuple[float, float] | None, fmt: str = "{:.4f}", n: int = 1) -> str:
    if ms is None:
        return "–"
    m, s = ms
    return fmt.format(m) + (" ± " + fmt.format(s).lstrip("+") if n > 1 else "")


def _pct(x: float | None) -> str:
    if x is None:
        return "–"
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
        "val loss",
        "ppl vs Q-K-V",
        "tokens/s",
        "seeds",
        "paper: ppl vs Q-K-V",
        "paper: KV vs Q-K-V",
    ]
    body = []
    for r in rows:
        pc, pp, pk = r.ppl_change_mean_std, r.paper_ppl_change, r.paper_kv_fraction
        body.append(
            [
                f"`{r.variant}`",
                _human(r.params.total),
                _human(r.params.non_embedding),
                f"{r.kv_bytes:,}",
                _pct(r.kv_fraction),
                _pm(r.val_loss_mean_std, n=r.n),
                ("reference" if r.variant == BASELINE else _pm(pc, "{:+.2f}%", r.n)) if pc else "–",
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
        body.append([f"`{v}`", _human(first.params.total)] + cells + [mean, paper_mean])
    return _md_table(header, body)


def paper_a_params_table() -> str:
    """Our analytic counts at Paper A's GPT-2 small config against the paper's figures."""
    from qkvlab.config import preset

    base = preset("gpt2-124m")
    body = []
    for name, paper in pf.PAPER_A_NON_EMBEDDING_M.items():
        ours = analytic_params(parse_variant(name).apply(base)).non_embedding / 1e6
        body.append([f"`{name}`", f"{ours:.2f}M", f"{paper:.2f}M", "yes" if abs(ours - paper) < 0.005 else "no"])
    return _md_table(["variant", "qkvlab (analytic)", "Paper A", "match"], body, "lrrl")


ICON = {pf.REPRODUCED: "✅", pf.NOT_REPRODUCED: "❌", pf.NOT_TESTED: "➖"}


def verdicts_md(verdicts: Sequence[pf.Verdict]) -> str:
    if not verdicts:
        return "No claim of the papers covers these tasks.\n"
    tested = [v for v in verdicts if v.status != pf.NOT_TESTED]
    untested = [v for v in verdicts if v.status == pf.NOT_TESTED]
    ok = sum(v.status == pf.REPRODUCED for v in tested)
    lines = [f"Reproduced {ok} of {len(tested)} claims tested here.", ""]
    for v in tested:
        lines.append(f"- {ICON[v.status]} **{v.status}** — Paper {v.claim.paper}: {v.claim.text}. Here: {v.detail}.")
    if untested:
        lines += [
            "",
            f"Not tested ({len(untested)}; a variant or task they need was not run): "
            + "; ".join(f"{v.claim.text} ({v.detail})" for v in untested)
            + ".",
        ]
    return "\n".join(lines) + "\n"


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
    return "\n".join(lines) + "\n"


def to_markdown(res: Results, plots: Sequence[str] = ()) -> str:
    m = res.manifest
    title = m.get("task_label") or ", ".join(res.tasks)
    out = [f"# qkvlab compare: {title}", ""]
    if not res.rows:
        out += ["No run has finished yet.", ""]
    lm_tasks = [t for t in res.tasks if all(r.metric == "val_loss" for r in res.rows if r.task == t)]
    other = [t for t in res.tasks if t not in lm_tasks]
    for t in lm_tasks:
        out += [
            f"## {t}: validation loss and perplexity",
            "",
            lm_table(res, t),
            "",
            "Mean ± sample std over seeds. Perplexity change is exp(loss − loss of Q-K-V) − 1, paired by seed. "
            "KV cache: bytes per token over all layers in bf16 (the distinct key/value tensors). "
            "Paper columns: Paper B 300M (SlimPajama, 10B tokens) and Paper A GPT-2 124M (OpenWebText); "
            "KV vs Q-K-V of the paper is for its 16-head model (GQA-g keeps g of 16 heads).",
            "",
        ]
    if other:
        metric = res.rows[[r.task for r in res.rows].index(other[0])].metric
        out += [
            f"## {metric} per task",
            "",
            family_table(res, other),
            "",
            "Mean ± sample std over seeds (and grid points); in parentheses Paper B's Table 1/2 figure where it "
            "reports one (mnist5k is compared with the paper's MNIST). Paper's grid and data are larger.",
            "",
        ]
    out += ["## The papers' orderings", "", verdicts_md(res.verdicts())]
    if "lm" in res.tasks:
        out += ["## Paper A's parameter counts at GPT-2 small (analytic, no training)", "", paper_a_params_table(), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    out += ["## Run", "", _run_section(res)]
    return "\n".join(out)


def write_results(out_dir: str | Path, res: Results | None = None, *, plots: bool = True) -> Results:
    """Collect (unless given) and write results.md, results.csv and the plots into out_dir."""
    from qkvlab.io import atomic_write_text

    out_dir = Path(out_dir)
    res = res or collect(out_dir)
    written: list[Path] = []
    if plots and res.rows:
        from qkvlab.analysis.plots import write_plots

        written = write_plots(res, out_dir)
    atomic_write_text(out_dir / "results.csv", to_csv(res))
    atomic_write_text(out_dir / "results.md", to_markdown(res, [str(p) for p in written]))
    return res
