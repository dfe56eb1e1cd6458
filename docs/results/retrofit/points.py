"""Every documented SmolLM2-135M retrofit point in one table (points.csv) and one plot (points.png).

    python docs/results/retrofit/points.py

Reads the committed files beside this script (the README's tables are the index of what is documented) and
writes points.csv and points.png beside it, replacing its own earlier ones. One row per point:

- route: K=V, MQA (GQA for other head counts), K=V+MQA, latent (`--kv-latent`), MLA (`--kv-latent --rope-dim`),
  from the run's own options (retrofit.json), a latent.py row's rank, or the K=V fit sweep;
- cache_fraction: KV-cache bytes per token / the original's (the layer count and head/rank choice live in it);
- distill_tokens: tokens of distillation behind the model, 0 for a fit alone;
- text: shakespeare (the held-out windows every retrofit reports), moby-dick, sotu-2000 (never read by a run);
- ppl, ppl_original: the point's perplexity and the original's on the same windows. The original comes from the
  same file where it has one (retrofit.json's ppl_original for the held-out text, a latent.py or curves.py
  file's original row); a subset_of_distilled.py file (subset.json, scores.json) has none for the other texts,
  so those take ORIGINALS' row (the same GGUF, scorer and 8,192 tokens), unless the run's folder scores the
  original itself (a row with layers_converted 0). A run whose held-out original is not ORIGINALS' (another
  source model) is refused rather than divided by the wrong original;
- wall_s: the distillation's wall seconds (the training loop's elapsed_s in retrofit.json, carried across
  --resume; fit and scoring excluded), on every row of a distilled model; empty for a fit alone;
- load: what ran beside that distillation, "quiet" or "not quiet", read from the README's own words (LOAD_SAYS,
  each quote checked to stand in README.md): no committed file records the load;
- source: the file(s) the row was read from (a fit copied into several run folders is one row, all named);
- ratio_lo, ratio_hi: the 95% interval of ppl / ppl_original over the held-out windows, where the report has it
  (`qkvlab retrofit`'s ratio_fit / ratio_uptrained).

MLA runs land as folders mla/NAME/ (retrofit.json as `qkvlab retrofit` writes it, steps.json from mla_steps.py
with --distilled: its fit and distilled rows on the other texts): a rerun adds them. Their load joins when LOAD_SAYS names the README's words for them.

Not in a committed file, so not in points.csv:
- the whole-run wall times, peak RSS and CPU shares the README states (e.g. 2:06:24 for smollm2_kv15_rest/);
  the sweep jobs' wall_s (latent.py, curves.py) cover several points at once and are not given per point;
- the 2026-11-29 table's "probe (issue; other text)" column (the issue's own figures, not runs here);
- the prototype's 178.9 -> 74.5 dev perplexity (original 51.7) before the refinement code existed;
- mla/PLAN.md's MLA fit at 50% (x1.013, 43.52 held-out) measured before the plan: no committed report;
- smollm2_kv15/'s Moby-Dick and sotu-2000 ("not measured" in the README).
Left out although committed: the small-model runs (small_qkv_to_qkeqv_*, small_qkeqv_scratch_*): a 4-layer
qkvlab model, not SmolLM2, whose ratios do not belong on SmolLM2's curves; the distillation's validation
windows (metrics.jsonl, drawn by distill_curves.py), a different measure from the held-out windows.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

from qkvlab.base.errors import UserError  # noqa: E402
from qkvlab.base.files import atomic_write, save_figure  # noqa: E402

HERE = Path(__file__).resolve().parent
ORIGINALS = "smollm2_kv30_mix/curves.json"  # the original on all three texts (its layers_converted 0 row)
TEXTS = {"heldout": "shakespeare", "moby-dick": "moby-dick", "sotu-2000": "sotu-2000"}
ROUTES = ("K=V", "MQA", "GQA", "K=V+MQA", "K=V+GQA", "latent", "MLA")  # the order of the table and the legend
SAME_ORIGINAL = 1e-3  # relative: further apart, a run's held-out original is another model's
# run (folder, or report file) -> the README's words on what ran beside its distillation
LOAD_SAYS = {
    "mla/mla25": "mla/mla25: not measured quiet",
    "mla/mla50": "mla/mla50: not measured quiet",
    "smollm2_kv15": "possibly while tests ran: not measured quiet",
    "smollm2_kv15_long": "not all quiet",
    "smollm2_kv15_lr1e-4_pilot": "the same fit as the 1,200-step run below; 9:12 wall, quiet",
    "smollm2_kv15_mix": "**Not measured quiet**: helpers' tests and benchmarks ran beside every run below",
    "smollm2_kv15_rest": "for fit, distillation and evaluations, **not quiet**",
    "smollm2_kv30": "**Not measured quiet**: other engineers' tests and benchmarks ran beside the fit",
    "smollm2_kv30_600": "**Not measured quiet**: other engineers' tests and benchmarks ran beside the fit",
    "smollm2_kv30_long": "(`smollm2_kv30_long/`). Not measured quiet",
    "smollm2_kv30_mix": "**Not measured quiet**: helpers' tests and benchmarks ran beside every run below",
    "smollm2_kv30_mix_lr1e-4": "(`smollm2_kv30_mix_lr1e-4/`; 30:44 wall, quiet)",
    "smollm2_kv30_rest": "7.6 GB peak RSS, **not quiet**",
    "smollm2_kvmqa18_mix": "43:30 wall, not quiet",
    "smollm2_mqa12_mix": "**Not measured quiet**: helpers' tests and benchmarks ran beside every run below",
    "smollm2_mqa23_mix": "**Not measured quiet**: a helper's tests ran beside it",
    "smollm2_k4_uptrained.json": "two runs at once",
    "smollm2_k30_uptrained.json": "two runs at once",
}


@dataclass(frozen=True)
class Point:
    route: str
    cache_fraction: float
    distill_tokens: int
    text: str
    ppl: float
    ppl_original: float
    wall_s: float | None = None
    load: str = ""
    source: str = ""
    ratio_lo: float | None = None
    ratio_hi: float | None = None

    @property
    def ratio(self) -> float:
        return self.ppl / self.ppl_original


COLUMNS = tuple(f.name for f in fields(Point))


def read_json(root: Path, rel: str) -> dict:
    return json.loads((root / rel).read_text())


def readme_loads(root: Path) -> dict[str, str]:
    """LOAD_SAYS as verdicts, each quote checked against the README (whitespace as one space)."""
    readme = " ".join((root / "README.md").read_text().split())
    loads = {}
    for run, quote in LOAD_SAYS.items():
        if quote not in readme:
            raise UserError(f"README.md no longer says {quote!r} (the load of {run}); update LOAD_SAYS in points.py")
        said_quiet = re.search(r"\bquiet\b", quote, re.I) and not re.search(r"\bnot\b", quote, re.I)
        loads[run] = "quiet" if said_quiet else "not quiet"
    return loads


def original_row(rows: list[dict]) -> dict[str, float] | None:
    """A curves.py / subset_of_distilled.py file's original (its layers_converted 0 row), by text."""
    row = next((r for r in rows if r.get("layers_converted") == 0), None)
    return None if row is None else {t: row[t] for t in TEXTS if t in row}


def route_of(options: dict) -> str:
    if options.get("rope_dim") is not None:
        return "MLA"
    if options.get("kv_latent") is not None:
        return "latent"
    parts = ["K=V"] if options.get("to") == "Q-K=V" else []
    heads = options.get("kv_heads")
    if heads is not None:
        parts.append("MQA" if heads == 1 else "GQA")
    if not parts:
        raise UserError(f"a retrofit with options {options} is none of the routes {', '.join(ROUTES)}")
    return "+".join(parts)


def interval(report: dict, key: str) -> tuple[float | None, float | None]:
    r = report.get(key)  # [estimate, lo, hi]; older reports have none, one window gives NaN bounds
    if not r or any(v is None or v != v for v in r[1:]):
        return None, None
    return r[1], r[2]


def report_points(report: dict, source: str, route: str, load: str) -> list[Point]:
    """A `qkvlab retrofit` report's own points: the fit and the distilled model, on the held-out text."""
    base = dict(route=route, cache_fraction=report["cache_ratio"], text=TEXTS["heldout"], source=source)
    ppl0 = report["ppl_original"]
    lo, hi = interval(report, "ratio_fit")
    out = [Point(distill_tokens=0, ppl=report["ppl_fit"], ppl_original=ppl0, ratio_lo=lo, ratio_hi=hi, **base)]
    if report.get("ppl_uptrained") is not None:
        up, (lo, hi) = report["uptraining"], interval(report, "ratio_uptrained")
        wall = round(up["last"]["elapsed_s"], 1)
        out.append(Point(distill_tokens=up["tokens"], ppl=report["ppl_uptrained"], ppl_original=ppl0,
                         wall_s=wall, load=load, ratio_lo=lo, ratio_hi=hi, **base))  # fmt: skip
    return out


def scored_points(rows: list[dict], originals: dict, source: str, route: str, run: Point | None) -> list[Point]:
    """Rows scored on several texts (subset_of_distilled.py, curves.py): every converted row, every text.
    run: the run's distilled point (tokens, wall, load), None for a fit alone."""
    out = []
    for row in rows:
        unknown = set(row) - {"layers_converted", "layers", "cache_fraction", *TEXTS}
        if unknown:  # a text under another name would be dropped without a word
            raise UserError(f"{source}: a row scores {sorted(unknown)}; the texts are named {', '.join(TEXTS)}")
        if row.get("layers_converted") == 0:
            continue  # the original itself
        for key, text in TEXTS.items():
            if key not in row:
                continue
            out.append(Point(route, row["cache_fraction"], 0 if run is None else run.distill_tokens, text, row[key],
                             originals[key], None if run is None else run.wall_s, "" if run is None else run.load,
                             source))  # fmt: skip
    return out


def step_points(body: dict, source: str, route: str, own: list[Point]) -> list[Point]:
    """mla_steps.py's file: the run's own fit and distilled model on the texts other than the held-out one
    (which the report gives), each against the original on the same windows, with its interval."""
    original = next(r for r in body["rows"] if r["step"] == "original")
    out = []
    for row, run in (
        (r, own[0] if r["step"] == "fit" else own[-1]) for r in body["rows"] if r["step"] in ("fit", "distilled")
    ):
        for text in (t for t in TEXTS.values() if t != TEXTS["heldout"] and t in row):
            ratio, lo, hi = row[text]
            out.append(Point(route, run.cache_fraction, run.distill_tokens, text, ratio * original[text], original[text],
                             run.wall_s, run.load, source, lo, hi))  # fmt: skip
    return out


def run_points(root: Path, folder: str, originals: dict, loads: dict) -> list[Point]:
    """A run folder: its retrofit.json, the scores (subset.json, scores.json ...) and curves.json beside it."""
    report = read_json(root, f"{folder}/retrofit.json")
    route = route_of(report["options"])
    own = report_points(report, f"{folder}/retrofit.json", route, loads.get(folder, ""))
    distilled = own[1] if len(own) > 1 else None
    scores, curves, steps = [], None, []
    for path in sorted((root / folder).glob("*.json")):
        body = json.loads(path.read_text())
        rows = body.get("rows") if isinstance(body, dict) else None
        if path.name == "curves.json":
            curves = body
        elif rows and "step" in rows[0]:
            steps += step_points(body, f"{folder}/{path.name}", route, own)
        elif rows and "layers_converted" in rows[0]:
            scores.append((path.name, rows))
    mine, scored = {"heldout": report["ppl_original"]}, set()
    for rows in [r for _, r in scores] + ([curves["cache_curve_fit_only"]] if curves else []):
        mine = {**(original_row(rows) or {}), **mine}  # the folder's own original, where it scored one
        scored |= {t for row in rows for t in TEXTS if t in row}
    texts, borrowed = {**originals, **mine}, scored - set(mine)
    if borrowed and abs(report["ppl_original"] / originals["heldout"] - 1) > SAME_ORIGINAL:
        raise UserError(
            f"{folder}: the original scores {report['ppl_original']:.4g} on the held-out text where {ORIGINALS} "
            f"scores {originals['heldout']:.4g}: another source model; score the original on every text in the "
            "folder (a scores row with layers_converted 0)"
        )
    out = list(own) + steps
    for name, rows in scores:
        out += scored_points(rows, texts, f"{folder}/{name}", route, distilled)
    if curves:
        src = f"{folder}/curves.json"
        out += scored_points(curves["cache_curve_fit_only"], texts, src, route, None)
        if curves.get("uptrained"):
            row = {**curves["uptrained"], "cache_fraction": report["cache_ratio"]}
            out += scored_points([row], texts, src, route, distilled)
    return out


def latent_points(root: Path, rel: str) -> list[Point]:
    """A latent.py file: every fitted row against the file's own original row, on every text."""
    rows = read_json(root, rel)["rows"]
    original = next(r for r in rows if r["route"] == "original")
    out = []
    for row in rows:
        if row is original:
            continue
        route = "latent" if "rank" in row else row["route"].split(",")[0]
        if route not in ROUTES:
            raise UserError(f"{rel}: row {row['route']!r} is none of the routes {', '.join(ROUTES)}")
        out += [Point(route, row["cache_fraction"], 0, text, row[k], original[k], source=rel)
                for k, text in TEXTS.items() if k in row]  # fmt: skip
    return out


def sweep_points(root: Path, rel: str) -> list[Point]:
    """The first K=V fit sweep (R² of V from K per layer, held-out ppl per layer count)."""
    body = read_json(root, rel)
    return [Point("K=V", r["cache_ratio"], 0, TEXTS["heldout"], r["ppl_fit"], body["ppl_original"], source=rel)
            for r in body["rows"] if r["layers_converted"] > 0]  # fmt: skip


def merged(points: list[Point]) -> list[Point]:
    """One row per point: the same measurement read from several files (a fit copied into several run folders,
    a run's held-out score in its report and its scores file) becomes one row naming every file."""
    rows: dict[tuple, Point] = {}
    for p in points:
        key = (p.route, p.cache_fraction, p.distill_tokens, p.text, p.ppl, p.ppl_original)
        q = rows.get(key)
        if q is None:
            rows[key] = p
            continue
        filled = ("wall_s", "load", "ratio_lo", "ratio_hi")  # from whichever file has them
        pick = {f: getattr(q, f) if getattr(q, f) not in (None, "") else getattr(p, f) for f in filled}
        rows[key] = replace(q, **pick, source=f"{q.source}; {p.source}")
    order = {r: i for i, r in enumerate(ROUTES)}
    return sorted(rows.values(), key=lambda p: (order[p.route], -p.cache_fraction, p.distill_tokens,
                                                list(TEXTS.values()).index(p.text), p.ppl, p.source))  # fmt: skip


def collect(root: Path = HERE) -> list[Point]:
    """Every point the committed files under root hold (run folders smollm2_*/ and mla/*/, the latent.py files,
    the first sweep and its reports)."""
    curves_rows = read_json(root, ORIGINALS)["cache_curve_fit_only"]
    originals, loads = original_row(curves_rows), readme_loads(root)
    points = []
    for report in sorted([*root.glob("smollm2_*/retrofit.json"), *root.glob("mla/*/retrofit.json")]):
        points += run_points(root, report.parent.relative_to(root).as_posix(), originals, loads)
    for rel in ("smollm2_latent/closed_form.json", "smollm2_latent/refined.json"):
        points += latent_points(root, rel)
    points += sweep_points(root, "smollm2_fit_sweep.json")
    for name in ("smollm2_k4_uptrained.json", "smollm2_k30_uptrained.json"):
        report = read_json(root, name)
        points += report_points(report, name, route_of(report["options"]), loads.get(name, ""))
    return merged(points)


def csv_text(points: list[Point]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for p in points:
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in astuple(p)])
    return buf.getvalue()


COLOURS = dict(zip(ROUTES, ("tab:blue", "tab:orange", "tab:brown", "tab:purple", "tab:pink", "tab:green", "tab:red")))
MARKERS = {"shakespeare": "o", "moby-dick": "s", "sotu-2000": "^"}
RATIO_TICKS = (0.95, 1.0, 1.1, 1.25, 1.5, 2, 3, 5, 8)


def draw_panel(ax, points: list[Point], x) -> None:
    """Every point at x(point): colour the route, marker the text, hollow a fit alone; bars the 95% interval."""
    for p in points:
        colour = COLOURS[p.route]
        face = "none" if p.distill_tokens == 0 else colour
        ax.plot(x(p), p.ratio, MARKERS[p.text], ms=6, mec=colour, mfc=face, alpha=0.85, lw=0)
        if p.ratio_lo is not None:
            ax.plot([x(p)] * 2, [p.ratio_lo, p.ratio_hi], color=colour, lw=1)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator(RATIO_TICKS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"×{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)


def legend_handles(points: list[Point]) -> list[Line2D]:
    routes = [r for r in ROUTES if any(p.route == r for p in points)]
    texts = [t for t in MARKERS if any(p.text == t for p in points)]
    intervals = any(p.ratio_lo is not None for p in points)

    def mark(label: str, marker: str, colour: str = "grey", face: str | None = None) -> Line2D:  # noqa: E306
        return Line2D([], [], marker=marker, lw=0, color=colour, mfc=face or colour, label=label)

    return [
        *(mark(r, "o", COLOURS[r]) for r in routes),
        *(mark(f"text: {t}" + (" (held-out)" if t == "shakespeare" else ""), MARKERS[t]) for t in texts),
        mark("fit alone (0 tokens)", "o", face="none"),
        mark("distilled", "o"),
        Line2D([], [], color="grey", lw=0.8, ls="--", label="the original (×1)"),
        *([Line2D([], [], color="grey", lw=1, label="95% interval over windows")] if intervals else []),
    ]


def draw(points: list[Point], out: Path) -> None:
    """Two panels: the ratio against the cache fraction, and against distillation tokens (0 = the fit)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 7), sharey=True)
    draw_panel(left, points, lambda p: p.cache_fraction)
    left.set_xlabel("KV cache per token, fraction of the original's bytes (smaller to the right)")
    left.set_ylabel("perplexity / the original's on the same windows (log)")
    left.set_title("against the cache (hollow: fit alone; filled: distilled)", fontsize=10)
    left.invert_xaxis()  # smaller caches to the right
    draw_panel(right, points, lambda p: p.distill_tokens)
    right.set_xscale("symlog", linthresh=1e4, linscale=0.6)
    right.xaxis.set_major_locator(FixedLocator([0, 1e4, 1e5, 1e6, 1e7]))
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "0 (fit)" if v == 0 else f"{v:,.0f}"))
    right.xaxis.set_minor_locator(NullLocator())
    right.set_xlim(-2e3, 4e6)
    right.set_xlabel("distillation tokens (log scale above 10,000)")
    right.set_title("against distillation (every route, every cache fraction)", fontsize=10)
    fig.suptitle(f"SmolLM2-135M retrofits: {len(points)} documented points (points.csv), ratio to the original",
                 fontsize=11)  # fmt: skip
    fig.legend(handles=legend_handles(points), loc="lower center", ncol=6, fontsize=8, bbox_to_anchor=(0.5, -0.08))
    save_figure(fig, out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    try:
        points = collect(HERE)
    except UserError as e:
        print(f"points.py: error: {e}", file=sys.stderr)
        return 2
    atomic_write(HERE / "points.csv", csv_text(points))
    draw(points, HERE / "points.png")
    for route in ROUTES:
        rows = [p for p in points if p.route == route]
        if rows:
            print(f"{route}: {len(rows)} rows")
    print(f"wrote {HERE / 'points.csv'} ({len(points)} rows) and {HERE / 'points.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
