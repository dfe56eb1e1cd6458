"""The scaling sweep on a lent H200 in one ~9-minute call (run by benchmarks/gpu_sweep.sh).

Fixed in advance (compare/recipes.py): the recipes gpu-L2 and gpu-L4 (sizes 0.39M .. 7.1M non-embedding
parameters, 4 seeds, Q-K-V and Q-K=V, 20 tokens per parameter, batch 128 x 128 at every size, lr per
size, bf16) on the sweep's corpus, the Linux 6.12 sources. Nothing there can be fetched, so the corpus
travels as xz (the "carry": `pack` here, `unpack` there, ~48 MiB) with the BPE tokenizer trained here;
there it is tokenized with 16 threads into the same token ids (train.bin's sha256 is checked).

Order and budget. A block is one size: every seed of both variants. Blocks run arm by arm (depth 2,
then depth 4), each arm in ascending N, and a block starts only if the pace measured on the blocks
before it (Pace: seconds per training FLOP of the arm's last block, plus each run's fixed seconds) says
it ends inside the budget; otherwise it and the arm's larger blocks are skipped, whole. So every size
reported has all its seeds, and where the cut falls depends on the machine's speed, never on a result.

Budget arithmetic (BUDGET_S 510 s of the ~9 min; the rest is the call's start and the copy back; the
shell script stops everything at BUDGET_S + 60 s): setup ~40 s (imports, xz, tokenizing 280 MB on 16
threads). A step of 16k tokens costs max(eager floor, FLOPs / R): the floor (kernel launches and the
loss's host sync every step) ~2 ms at depth 2 and ~3 ms at depth 4, R ~250 TFLOP/s of the ~790
measured there for large bf16 matmuls; plus ~1 s a run (evaluations, test split, saving). A size's 8
runs (scripts/sweep_plan.py): d128-L2 16 s, d208-L2 28, d336-L2 61, d544-L2 216 (8673 steps a run);
d92-L4 20, d148-L4 39, d240-L4 89: 469 s, ~510 s with the setup. So the plan fills the budget only at
that pace or better. Pace's FLOP scaling errs long (from d336's floor-bound 2 ms a step it predicts
d544's at ~4.9 ms, the model says 3.1): on a machine exactly as assumed, d544-L2 is predicted 349 s
with ~365 s left and runs (216 s); the depth-4 arm then runs d92 and d148, and its d240 (predicted
~195 s from d148's floor-bound pace, ~90 s left) is skipped. A slower machine stops the depth-2 arm at
2.7M instead. No shape is compiled: a compile per shape would cost more than a block.

Outputs ($OUT, at most 8 files come back): summary.txt (one PASS/FAIL/SKIP line per step), log.txt,
sweep.json (blocks, predictions, pace), and gpu-sweep.tar.gz: for each arm the compare folder's
results.md, results.csv, scores.json and compare.json, and under run-logs/ every run's config.json,
metrics.jsonl and test.json (the weights stay behind). Unpacked into docs/results/scaling/gpu/,
`qkvlab compare --render --out docs/results/scaling/gpu/gpu-L2` re-derives everything, plots included.

    OUT=out python3 benchmarks/gpu_sweep.py --carry data/sweep/gpu-carry   # on the GPU machine
    python3 benchmarks/gpu_sweep.py --cpu-dry --out /tmp/dry                # here: tiny, every code path
    python3 benchmarks/gpu_sweep.py --pack --carry data/sweep/gpu-carry     # here, after setup_sweep_corpus.sh
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_FORMAT = "qkvlab sweep carry 1"
ARMS = ("gpu-L2", "gpu-L4")
BUDGET_S = 510.0
CARRY_MAX_MIB = 52
SAFETY = 1.0  # the prediction already errs long (Pace); the hard stop and the per-block bundle cover the rest
# --cpu-dry: the same recipes on tiny shapes; the last block is sized to be skipped by the budget
DRY_SIZES = {
    "gpu-L2": "d8-L2-h2-b4-s2-lr0.01,d16-L2-h2-b4-s2-lr0.005,d512-L2-h4-b4-s2-lr0.001",
    "gpu-L4": "d8-L4-h2-b4-s2-lr0.01,d12-L4-h2-b4-s2-lr0.008",
}
DRY_SETTINGS = dict(tokens_per_param=0.5, device="cpu", jobs=1, threads=1, model={"context": 16})
DRY_BUDGET_S = 150.0


class Log:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text("")
        self.record: dict = {"blocks": [], "steps": {}}

    def line(self, verdict: str, name: str, figure: str) -> None:
        text = f"{verdict} {name}: {figure}"
        print(text, flush=True)
        with open(self.out / "summary.txt", "a", encoding="utf-8") as f:
            f.write(text + "\n")

    def save(self) -> None:
        tmp = self.out / "sweep.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "sweep.json")


# ---- the carry: the corpus as xz and the tokenizer, packed here, unpacked there -------------------
def pack(corpus: Path, prepared: Path, carry: Path, preset: int = 9 | lzma.PRESET_EXTREME) -> dict:
    """xz every .jsonl shard of `corpus` into `carry`, with the tokenizer and meta.json of `prepared`
    (its token counts and checksums, which `unpack` must reproduce)."""
    from qkvlab.data.prepare import META_NAME

    shards = sorted(corpus.glob("*.jsonl"))
    if not shards or not (prepared / META_NAME).is_file():
        raise SystemExit(f"pack needs {corpus}/*.jsonl and {prepared}/{META_NAME} (scripts/setup_sweep_corpus.sh)")
    carry.mkdir(parents=True, exist_ok=True)

    def one(path: Path) -> str:
        target = carry / (path.name + ".xz")
        with path.open("rb") as src, lzma.open(target, "wb", preset=preset) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        return target.name

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # lzma releases the GIL
        names = list(pool.map(one, shards))
    tok = carry / "tokenizer"
    tok.mkdir(exist_ok=True)
    for name in ("qkvlab_tokenizer.json", "bpe.json"):
        if (prepared / name).is_file():
            shutil.copy2(prepared / name, tok / name)
    meta = json.loads((prepared / META_NAME).read_text())
    body = {"format": CARRY_FORMAT, "shards": names, "prepared_meta": meta}
    (carry / "carry.json").write_text(json.dumps(body, indent=2) + "\n")
    return body


def unpack(carry: Path, work: Path, prepared_out: Path, threads: int | None = None):
    """The carry's shards decompressed into work/corpus, its tokenizer placed where prepare looks for
    the BPE of that corpus (so nothing is trained there), then `prepare` with the packed split; the
    result must hold the very tokens packed (train.bin and val.bin sha256)."""
    from qkvlab.data.prepare import prepare
    from qkvlab.data.sources import content_hash, corpus_units
    from qkvlab.data.tokenizer import TokenizerSpec, bpe_cache_path

    body = json.loads((carry / "carry.json").read_text())
    if body.get("format") != CARRY_FORMAT:
        raise RuntimeError(f"{carry}/carry.json is not a {CARRY_FORMAT!r} file")
    meta = body["prepared_meta"]
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> None:
        with lzma.open(carry / name, "rb") as src, open(corpus / name.removesuffix(".xz"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    with ThreadPoolExecutor(len(body["shards"]) or 1) as pool:
        list(pool.map(one, body["shards"]))
    sha, _ = content_hash(corpus_units(corpus))  # before prepare: a changed corpus would retrain the BPE there
    if sha != meta["corpus_sha256"]:
        raise RuntimeError(f"the unpacked corpus differs from the packed one in corpus_sha256: {sha[:12]}")
    spec = TokenizerSpec.parse(meta["tokenizer"])
    if spec.kind == "bpe":
        shutil.copytree(carry / "tokenizer", bpe_cache_path(meta["corpus_sha256"], spec.vocab_size), dirs_exist_ok=True)
    split = meta["split"]  # as it was prepared here (the sweep's: SWEEP_CORPUS_PREPARE)
    data = prepare(
        corpus,
        meta["tokenizer"],
        prepared_out,
        val_fraction=split["val_fraction"],
        split=split["rule"],
        threads=threads,
    )
    for key in ("corpus_sha256", "tokens", "bin_sha256"):
        if data.meta.get(key) != meta.get(key):
            raise RuntimeError(f"the unpacked corpus differs from the packed one in {key}: {data.meta.get(key)}")
    return data


# ---- the sweep ------------------------------------------------------------------------------------
def plans(data: Path, dry: bool, out: Path):
    """Each arm's Plan, as `qkvlab compare --sweep --recipe gpu-L.. --data DATA --out OUT/gpu-L..` plans it."""
    from qkvlab.compare import CompareConfig, plan

    found = {}
    for arm in ARMS:
        extra = dict(DRY_SETTINGS, sizes=DRY_SIZES[arm]) if dry else {}
        cfg = CompareConfig(sweep=True, recipe=arm, data=str(data), out=str(out / arm), plots=True, **extra)
        found[arm] = plan(cfg)
    return found


def blocks(found: dict) -> list[tuple[int, str, str, list]]:
    """(N, arm, size label, runs) per size: the arms in ARMS order (depth 2 first: reaching far in N is
    what only the GPU can do; the CPU sweep has both arms up to 1M), each in ascending N."""
    from qkvlab.model.accounting import analytic_params

    out = []
    for arm, p in found.items():
        mine = []
        for label in dict.fromkeys(r.point for r in p.runs):
            runs = [r for r in p.runs if r.point == label]
            base = runs[0].cfg.model.replace(attn="Q-K-V", kv_heads=None, match_params=None)
            mine.append((analytic_params(base).non_embedding, arm, label, runs))
        out += sorted(mine, key=lambda b: b[0])
    return out


def work_of(runs) -> float:
    from qkvlab.compare.pace import step_work

    return sum(step_work(r.cfg) * r.cfg.max_steps for r in runs)


class Pace:
    """A block's seconds, predicted from the blocks run so far: its training FLOPs at the seconds per
    FLOP of the last block of the same arm (the largest so far at that depth: per FLOP, smaller models
    run slower, so this errs long), else of the last block of any arm; plus each run's fixed seconds
    (wall minus training: evaluations, the test split, saving), the mean over every run so far."""

    def __init__(self):
        self.rate: dict[str, float] = {}  # arm -> seconds per training FLOP of its last block
        self.last: float | None = None
        self.fixed_s = 0.0
        self.runs = 0

    def add(self, runs, wall_s: float, arm: str = "") -> None:
        from qkvlab.model.folder import read_metrics

        trained = 0.0
        for r in runs:
            rows = read_metrics(r.dir)
            trained += float(rows[-1].get("elapsed_s") or 0.0) if rows else 0.0
        work = work_of(runs)
        if work > 0:
            self.rate[arm] = self.last = trained / work
        self.fixed_s += max(0.0, wall_s - trained)
        self.runs += len(runs)

    def predict(self, runs, arm: str = "") -> float | None:
        rate = self.rate.get(arm, self.last)
        if rate is None or not self.runs:
            return None
        return rate * work_of(runs) + self.fixed_s / self.runs * len(runs)


def run_blocks(found: dict, log: Log, budget_s: float, start: float) -> None:
    """Every block in ascending N that the pace says fits (see the module doc); the bundle is rewritten
    after each, so a call stopped by its lease still brings back every block that finished."""
    from qkvlab.compare import run

    pace = Pace()
    cut: set[str] = set()  # arms whose next size did not fit: their larger sizes are not tried
    for n, arm, label, runs in blocks(found):
        entry = {"arm": arm, "size": label, "N": n, "runs": len(runs), "work_flops": work_of(runs)}
        left = budget_s - (time.monotonic() - start)
        guess = pace.predict(runs, arm)
        entry.update(predicted_s=guess, left_s=round(left, 1))
        if arm in cut or (guess is not None and guess * SAFETY > left) or left <= 0:
            cut.add(arm)
            entry["state"] = "skipped"
            log.line(
                "SKIP", f"{arm} {label}", f"N {n:,}, {len(runs)} runs: predicted {guess or 0:.0f} s, {left:.0f} s left"
            )
        else:
            p = found[arm]
            t0 = time.monotonic()
            outcome = run(dataclasses.replace(p, runs=runs), command=_command(arm, p), say=lambda *a, **k: None)
            wall = time.monotonic() - t0
            pace.add(runs, wall, arm)
            entry.update(state="ran", wall_s=round(wall, 1), failures=outcome.failures)
            verdict = "FAIL" if outcome.failures else "PASS"
            log.line(
                verdict,
                f"{arm} {label}",
                f"N {n:,}, {len(runs)} runs in {wall:.1f} s (predicted {'-' if guess is None else f'{guess:.0f} s'})"
                + (f"; diverged: {outcome.failures[0]}" if outcome.failures else ""),
            )
        log.record["blocks"].append(entry)
        log.save()
        if entry["state"] == "ran":
            bundle(found, log.out)


def _command(arm: str, p) -> str:
    c = p.config
    return f"qkvlab compare --sweep --recipe {arm} --data {c.data} --out {c.out}  (benchmarks/gpu_sweep.py)"


def bundle(found: dict, out: Path) -> Path:
    """gpu-sweep.tar.gz: each arm's results and every run's small files (no weights)."""
    keep_top = ("results.md", "results.csv", "scores.json", "compare.json")
    keep_run = ("config.json", "metrics.jsonl", "test.json")
    target = out / "gpu-sweep.tar.gz"
    with tarfile.open(target, "w:gz") as tar:
        for arm, p in found.items():
            folder = Path(p.out)
            for name in keep_top:
                if (folder / name).is_file():
                    tar.add(folder / name, f"{arm}/{name}")
            for path in sorted(folder.glob("*/*/*/*")):
                if path.name in keep_run:  # one level down: weightless run folders would read as unfinished runs
                    tar.add(path, f"{arm}/run-logs/{path.relative_to(folder)}")
    return target


def step(log: Log, name: str, fn):
    """One PASS/FAIL line for a setup step; the exception's first line on failure (None returned)."""
    t0 = time.monotonic()
    try:
        value, figure = fn()
    except Exception as e:  # noqa: BLE001 - the summary must say what broke, then the script stops
        print(traceback.format_exc()[-3000:], flush=True)
        log.line("FAIL", name, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")
        return None
    seconds = time.monotonic() - t0
    log.record["steps"][name] = round(seconds, 1)
    log.line("PASS", name, f"{figure} ({seconds:.0f} s)")
    return value


def dry_carry(work: Path) -> Path:
    """--cpu-dry's carry: a slice of the Shakespeare plays as two .jsonl shards, prepared here, packed."""
    from qkvlab.compare.recipes import SWEEP_CORPUS_PREPARE
    from qkvlab.data.prepare import prepare
    from qkvlab.data.text import load_shakespeare
    from qkvlab.data.tokenizer import bpe_cache_path

    corpus = work / "dry-corpus"
    corpus.mkdir(parents=True)
    plays = list(load_shakespeare())[:4]
    for i, half in enumerate((plays[:2], plays[2:])):
        rows = "".join(json.dumps({"text": d.text[:60_000]}) + "\n" for d in half)
        (corpus / f"shard{i:03d}.jsonl").write_text(rows)
    p = SWEEP_CORPUS_PREPARE
    prepared = work / "dry-prepared"
    data = prepare(corpus, "bpe:300", prepared, val_fraction=0.05, split=p["split"])  # 5%: the test split has windows
    pack(corpus, prepared, work / "dry-carry", preset=1)
    # the BPE cached by this prepare must not be found by unpack's: there it comes from the carry
    shutil.rmtree(bpe_cache_path(data.meta["corpus_sha256"], 300), ignore_errors=True)
    return work / "dry-carry"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="summary, log, sweep.json, the results bundle")
    ap.add_argument("--carry", default=str(ROOT / "data/sweep/gpu-carry"), help="the packed corpus (--pack makes it)")
    ap.add_argument("--cpu-dry", action="store_true", help="tiny shapes on the CPU, its own tiny corpus")
    ap.add_argument(
        "--budget-s", type=float, default=None, help=f"training budget (default {BUDGET_S:g}; dry {DRY_BUDGET_S:g})"
    )
    ap.add_argument("--pack", action="store_true", help="make the carry from the corpus setup_sweep_corpus.sh built")
    args = ap.parse_args(argv)
    if args.pack:
        from qkvlab.compare.recipes import SWEEP_CORPUS

        body = pack(ROOT / "data/sweep/linux-6.12", ROOT / SWEEP_CORPUS, Path(args.carry))
        size = sum(f.stat().st_size for f in Path(args.carry).rglob("*") if f.is_file())
        print(f"{args.carry}: {len(body['shards'])} shards, {size / 2**20:.1f} MiB")
        if size > CARRY_MAX_MIB * 2**20:  # the lease's 64 MiB holds the tree (~8 MiB) and this
            print(f"the carry is over {CARRY_MAX_MIB} MiB: with the working tree it will not travel", file=sys.stderr)
            return 1
        return 0
    start = time.monotonic()
    import torch

    out = Path(args.out).resolve()
    log = Log(out)
    if not args.cpu_dry and not torch.cuda.is_available():
        log.line("FAIL", "device", "no CUDA device (use --cpu-dry here)")
        return 2
    budget = args.budget_s or (DRY_BUDGET_S if args.cpu_dry else BUDGET_S)
    work = Path(os.environ.get("QKVLAB_SWEEP_WORK") or tempfile.mkdtemp(prefix="gpu-sweep-"))
    os.environ.setdefault("QKVLAB_CACHE", str(work / "cache"))
    where = "cpu (--cpu-dry)" if args.cpu_dry else torch.cuda.get_device_name(0)
    log.record.update(device=where, torch=torch.__version__, budget_s=budget, dry=args.cpu_dry)
    print(f"torch {torch.__version__}, {where}, budget {budget:.0f} s, work {work}", flush=True)
    try:
        carry = Path(args.carry)
        if args.cpu_dry:
            carry = step(log, "dry-carry", lambda: (dry_carry(work), "a tiny corpus packed as the real one is"))
            if carry is None:
                return 1
        threads = os.cpu_count()
        data = step(
            log,
            "corpus",
            lambda: (
                (d := unpack(carry, work, work / "prepared", threads)),
                f"{d.meta['tokens']['train']:,} training tokens, sha256 {d.meta['corpus_sha256'][:12]} as packed",
            ),
        )
        if data is None:
            return 1
        found = step(log, "plan", lambda: ((f := plans(data.out_dir, args.cpu_dry, work)), _describe(f)))
        if found is None:
            return 1
        run_blocks(found, log, budget, start)
        target = step(log, "bundle", lambda: ((t := bundle(found, out)), f"{t.name}, {t.stat().st_size / 1e6:.2f} MB"))
        log.record["total_s"] = round(time.monotonic() - start, 1)
        log.save()
        print(f"total {time.monotonic() - start:.0f} s", flush=True)
        text = (out / "summary.txt").read_text()
        return 1 if target is None or "FAIL" in text.split() else 0
    finally:
        if not os.environ.get("QKVLAB_SWEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)


def _describe(found: dict) -> str:
    sizes = {arm: sorted({r.point for r in p.runs}) for arm, p in found.items()}
    return "; ".join(f"{arm} {len(p.runs)} runs, {len(sizes[arm])} sizes" for arm, p in found.items())


if __name__ == "__main__":
    sys.exit(main())
