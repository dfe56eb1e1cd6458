"""The next sweep's plan as a table, from the named recipes (compare/recipes.py SWEEP_RECIPES), without
training or timing anything here: per recipe and size, N, tokens D, steps, epochs of the training
split and the estimated wall time, for docs/results/scaling/README.md ("next sweep").

Time: compare's own estimate (pace.Layout.plan_seconds: seconds per step scaled by training FLOPs per
step, runs `jobs` at a time) at two paces recorded on this project's 2-core machines, 2 jobs x 1
thread, fp32 (no probe runs: the CPU is shared):
- EPYC: the lm family (docs/results/lm), Q-K-V d64-L2-h4 at batch 16 x 128, 14,425 tokens/s per run;
- Xeon: the old sweep (docs/results/scaling), Q-K-V d128-L2-h4 at batch 32 x 128, 1923 steps in 488 s.
FLOP scaling from a small model over-states a larger one's time on a CPU (wider matrices run nearer
peak): the old sweep ran 40 GFLOP/s at d48 and 57 at d128 on the Xeon (1.4x); the EPYC reference, d64
in the lm family, ran 17, so its column is the pessimistic one.
GPU (gpu-L2, gpu-L4): benchmarks/gpu_sweep.py's arithmetic (eager floor per step, else FLOPs at R).

Epochs: D over the training split, the prepared corpus's meta.json when it is there, else 280 MB of
text at 1.80 characters a token (a 20 MB sample) less the held-out 0.15%; Shakespeare's 1,906,194.

    python scripts/sweep_plan.py            # markdown on stdout
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qkvlab.compare import CompareConfig, plan
from qkvlab.compare.pace import Layout, first_run_per_point, step_work
from qkvlab.compare.recipes import SWEEP_CORPUS, SWEEP_CORPUS_MB, SWEEP_CORPUS_PREPARE, SWEEP_RECIPES
from qkvlab.model.accounting import analytic_params, flops_per_token
from qkvlab.model.config import ModelConfig
from qkvlab.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE_TRAIN = 1_906_194  # BPE-1024 training split (scripts/record_split_tokens.py)
CHARS_PER_TOKEN = 1.80  # BPE-1024 on a 20 MB sample of the corpus (setup_sweep_corpus.sh, MAX_MB=20)
# GPU model (benchmarks/gpu_sweep.py): a step costs max(floor, FLOPs / R)
GPU_R = 250e12
GPU_FLOOR_S = {2: 2e-3, 4: 3e-3}
GPU_FIXED_S = 1.0  # per run: evaluations, the test split, saving


def _reference(d: int, batch: int, seconds_per_step: float, note: str) -> Layout:
    """compare's Layout at a recorded pace: 2 jobs x 1 thread, the step time of a Q-K-V run at d, L2, h4."""
    model = ModelConfig(d_model=d, n_layer=2, n_head=4, vocab_size=1024, context=128).validate()
    cfg = TrainConfig.from_dict(dict(task="lm", model=model, batch_size=batch, max_steps=1))
    return Layout(2, 1, seconds_per_step, note, step_work(cfg))


PACES = {
    "EPYC": _reference(64, 16, 16 * 128 / 14_424.9, "lm family, docs/results/lm"),
    "Xeon": _reference(128, 32, 488.0 / 1923, "old sweep, docs/results/scaling"),
}


def train_tokens(recipe: dict) -> tuple[int, str]:
    if "data" not in recipe:
        return SHAKESPEARE_TRAIN, "Shakespeare, BPE-1024"
    meta = ROOT / SWEEP_CORPUS / "meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["tokens"]["train"]), "prepared corpus"
    estimate = SWEEP_CORPUS_MB * 1e6 / CHARS_PER_TOKEN * (1 - SWEEP_CORPUS_PREPARE["val_fraction"])
    return int(estimate), "estimated: 280 MB at 1.80 characters a token"


def recipe_plan(name: str):
    """The recipe's plan; a recipe whose lr comes from its scan is planned at the 1/width rule's lr
    (the steps, tokens and cost do not depend on the lr)."""
    r = SWEEP_RECIPES[name]
    if "lr_scan" in r:
        keys = ("sizes", "variants", "data", "tokenizer", "tokens_per_param", "dtype")
        return plan(CompareConfig(sweep=True, out="/nowhere", **{k: r[k] for k in keys if k in r}))
    return plan(CompareConfig(sweep=True, recipe=name, out="/nowhere"))


def gpu_seconds(run) -> float:
    c = run.cfg
    step = max(GPU_FLOOR_S[c.model.n_layer], flops_per_token(c.model) * c.batch_size * c.model.context / GPU_R)
    return step * c.max_steps + GPU_FIXED_S


def table(name: str) -> tuple[list[str], dict[str, float]]:
    p = recipe_plan(name)
    tokens, where = train_tokens(SWEEP_RECIPES[name])
    gpu = name.startswith("gpu")
    head = "| size | N | D (tokens) | steps | epochs | runs | " + (
        "est. s (H200) |" if gpu else "est. min (EPYC) | est. min (Xeon) |"
    )
    lines = [f"**{name}** ({len(p.runs)} runs; training split {tokens:,} tokens, {where})", "", head]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + ("" if gpu else " ---: |"))
    totals = {k: 0.0 for k in (("H200",) if gpu else PACES)}
    for first in first_run_per_point(p.runs).values():
        runs = [r for r in p.runs if r.point == first.point]
        c = first.cfg
        n = analytic_params(c.model.replace(attn="Q-K-V", kv_heads=None)).non_embedding
        d = c.max_steps * c.batch_size * c.model.context
        cells = [first.point, f"{n:,}", f"{d:,}", f"{c.max_steps:,}", f"{d / tokens:.3f}", str(len(runs))]
        if gpu:
            s = sum(gpu_seconds(r) for r in runs)
            totals["H200"] += s
            cells.append(f"{s:.0f}")
        else:
            for pace_name, layout in PACES.items():
                s = layout.plan_seconds(runs)
                totals[pace_name] += s
                cells.append(f"{s / 60:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "total: " + ", ".join(_fmt(k, v, gpu) for k, v in totals.items()), ""]
    return lines, totals


def _fmt(pace: str, seconds: float, gpu: bool) -> str:
    return f"{seconds:.0f} s of training on the H200" if gpu else f"{seconds / 3600:.1f} h at the {pace} pace"


def main() -> int:
    out = []
    for name in SWEEP_RECIPES:
        lines, _ = table(name)
        out += lines
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
