"""results.csv of a compare folder: one row per (task, variant) with its scores, the gap to Q-K-V with
its interval and trend, throughput and the papers' figures beside them."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from qkvlab.analysis.results import Results
from qkvlab.analysis.verdicts import PERPLEXITY_METRIC

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
    "scored_on",
    "val_loss_mean",
    "val_loss_std",
    "ppl_change_pct_mean",
    "ppl_change_pct_std",
    "gap_vs_qkv",
    "gap_vs_qkv_lo",
    "gap_vs_qkv_hi",
    "gap_unit",
    "gap_trend",
    "gap_trend_slope_per_10pct",
    "gap_trend_slope_lo",
    "gap_trend_slope_hi",
    "tokens_per_s",
    "steps",
    "seeds",
    "seeds_planned",
    "paper_metric",
    "paper_ppl_change_pct",
    "paper_kv_cache_fraction",
)


def _num(x: float) -> float | str:
    return "" if x is None or math.isnan(x) else round(x, 6)


def csv_rows(res: Results) -> list[dict[str, Any]]:
    out = []
    gaps = res.gaps()
    trends = {(task, traj.variant): tr for task, traj, tr in res.trends()}
    for r in res.rows:
        gap, tr = gaps.get((r.task, r.variant)), trends.get((r.task, r.variant))
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
                "scored_on": r.scored_on,
                "val_loss_mean": lm,
                "val_loss_std": ls,
                "ppl_change_pct_mean": pc[0] if pc else "",
                "ppl_change_pct_std": pc[1] if pc else "",
                "gap_vs_qkv": _num(gap.estimate) if gap else "",
                "gap_vs_qkv_lo": _num(gap.lo) if gap else "",
                "gap_vs_qkv_hi": _num(gap.hi) if gap else "",
                "gap_unit": ("% perplexity" if r.metric == PERPLEXITY_METRIC else f"{r.metric} points") if gap else "",
                "gap_trend": (tr.word or "") if tr else "",
                "gap_trend_slope_per_10pct": _num(tr.per_10pct.estimate) if tr else "",
                "gap_trend_slope_lo": _num(tr.per_10pct.lo) if tr else "",
                "gap_trend_slope_hi": _num(tr.per_10pct.hi) if tr else "",
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
