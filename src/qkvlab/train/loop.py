"""The training loop: any task, any scheme, one process or many; resumable bit for bit.

Determinism is the design: a step's batch is a function of (seed, step) (tasks/base.py), the
learning rate a function of the step, and the checkpoint holds weights, optimizer state, per-rank
RNG states and every metrics row so far. Resuming from it replays the remaining steps exactly, so
a run killed at any moment and resumed ends with the same weights and metrics.jsonl values as an
uninterrupted one (CPU, same world size); only the timing fields tokens_per_s and elapsed_s differ.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qkvlab.devices import torch_dtype
from qkvlab.errors import UserError
from qkvlab.io import atomic_write_text
from qkvlab.tasks import get_task
from qkvlab.train import checkpoint as ck
from qkvlab.train import distributed as D
from qkvlab.train.config import TrainConfig, changed_fields
from qkvlab.train.optim import lr_at, make_optimizer

METRICS = "metrics.jsonl"
TRAIN_CONFIG = "train_config.json"
TIMING_FIELDS = ("tokens_per_s", "elapsed_s")  # wall-clock, excluded from exact comparisons


class TrainingDiverged(RuntimeError):
    """The loss became non-finite; the message is one line. The CLI exits with status 3."""


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    tokens: int
    metrics: dict[str, Any]  # the last metrics.jsonl row
    history: list[dict[str, Any]] = field(default_factory=list)
    params: int = 0
    tokens_per_s: float = 0.0
    metric: str = "val_loss"
    higher_is_better: bool = False


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_metrics(out: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(out / METRICS, "".join(json.dumps(r) + "\n" for r in rows))


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def _rng_state(env: D.Env) -> dict[str, Any]:
    """This rank's RNG states (dropout), base64 of the byte tensors."""
    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    state = {"torch": enc(torch.get_rng_state())}
    if env.device.type == "cuda":
        state["cuda"] = enc(torch.cuda.get_rng_state(env.device))
    return state


def _set_rng_state(env: D.Env, state: dict[str, Any]) -> None:
    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(dec(state["torch"]))
    if env.device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(dec(state["cuda"]), env.device)


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Second name of a shared parameter -> first name (tied embeddings are stored once)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _check_resumable(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    now = cfg.to_dict()
    for key in changed_fields(saved, cfg):  # RESUMABLE_FIELDS (train/config.py) may change
        raise UserError(
            f"{where} was trained with {key}={json.dumps(saved.get(key))}, not "
            f"{json.dumps(now.get(key))}; resume with the same {key} or use another --out"
        )


def _result(out: Path, cfg: TrainConfig, state: dict[str, Any], tokens_per_s: float) -> TrainResult:
    rows = state["metrics"]
    return TrainResult(
        out_dir=out,
        step=state["step"],
        tokens=state["tokens"],
        metrics=rows[-1] if rows else {},
        history=rows,
        params=state["params"],
        tokens_per_s=tokens_per_s,
        metric=state.get("metric", "val_loss"),
        higher_is_better=state.get("higher_is_better", False),
    )


def _finish(out: Path, ckpt: Path, cfg: TrainConfig, state: dict[str, Any]) -> None:
    last = state["metrics"][-1] if state["metrics"] else {}
    ck.write_final_model(
        out,
        ckpt,
        {
            "train": {
                "finished": True,
                "step": state["step"],
                "tokens": state["tokens"],
                "metrics": last,
                "task": state.get("task"),
                "config": cfg.to_dict(),
            }
        },
    )


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train `cfg` into `out_dir` (see module doc). With resume=True: continue from OUT's last
    complete checkpoint, start fresh if there is none, return at once if it is already finished.
    Under torchrun the process group is set up (and torn down) here."""
    cfg = TrainConfig.from_dict(cfg.to_dict())  # validated private copy
    env = D.setup(cfg.device)
    try:
        return _train(cfg, Path(out_dir), env, resume, progress)
    finally:
        D.teardown(env)


def _train(cfg: TrainConfig, out: Path, env: D.Env, resume: bool, progress: bool) -> TrainResult:
    accum = cfg.accum_steps(env.world)
    # ---- where are we? (rank 0 repairs an interrupted checkpoint write, then everyone looks)
    if env.main:
        out.mkdir(parents=True, exist_ok=True)
        found = ck.find_checkpoint(out, repair=True)
    D.barrier(env)
    found = ck.find_checkpoint(out, repair=False)
    if found is not None and not resume:
        raise UserError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    weights = optim_state = state = None
    if found is not None:
        weights, optim_state, state = ck.load_checkpoint(found)
        _check_resumable(state["train_config"], cfg, out)
        if state["step"] > cfg.max_steps:
            raise UserError(f"{found} is at step {state['step']}, beyond max_steps={cfg.max_steps}")
        if state["step"] == cfg.max_steps:  # finished: (re)publish the final model and metrics, no training
            if env.main:
                _write_metrics(out, state["metrics"])
                _finish(out, found, cfg, state)
            D.barrier(env)
            timed = [r["tokens_per_s"] for r in state["metrics"] if r.get("tokens_per_s")]
            return _result(out, cfg, state, sum(timed) / len(timed) if timed else 0.0)  # as recorded

    # ---- task (rank 0 first: it may tokenize and cache the corpus), model, optimizer
    task = get_task(cfg.task, **cfg.task_options) if env.main else None
    D.barrier(env)
    task = task or get_task(cfg.task, **cfg.task_options)
    model_cfg = task.adapt_config(cfg.model)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    raw = task.build_model(model_cfg).to(env.device)
    kind = "gpt" if type(raw).__name__ == "GPT" else "encoder"
    tied = _tied_names(raw)
    params = sum(p.numel() for p in raw.parameters())
    sharded = env.distributed and cfg.sharding == "fsdp"
    if sharded:
        D.shard(raw, env)
    optimizer = make_optimizer(raw, cfg.lr, cfg.weight_decay, cfg.betas, env.device)
    fwd = torch.compile(raw) if cfg.compile else raw  # eval and the FSDP forward run this
    train_fwd = D.replicate(fwd, env) if env.distributed and cfg.sharding == "ddp" else fwd
    dtype = torch_dtype(cfg.dtype, env.device.type)
    autocast = torch.autocast(env.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    if state is not None:  # resume
        D.load_full_state(raw, optimizer, {**weights, **{d: weights[c] for d, c in tied.items()}}, optim_state, sharded)
        rngs = state["rng"]
        if len(rngs) == env.world:
            _set_rng_state(env, rngs[env.rank])
        else:  # another world size: dropout streams cannot continue; re-derive them
            torch.manual_seed(_seed(cfg.seed, state["step"], env.rank))
        step, rows = state["step"], state["metrics"]
        loss_sum, loss_n, elapsed = state["loss_sum"], state["loss_n"], state["elapsed_s"]
    else:
        torch.manual_seed(_seed(cfg.seed, 0, env.rank))  # per-rank dropout streams
        step, rows, loss_sum, loss_n, elapsed = 0, [], 0.0, 0, 0.0
    del weights, optim_state
    if env.main:
        _write_metrics(out, rows)  # truncates rows written after the checkpoint
        atomic_write_text(out / TRAIN_CONFIG, json.dumps(cfg.to_dict(), indent=2) + "\n")

    tb = None
    if cfg.log_tensorboard and env.main:
        with contextlib.suppress(ImportError):
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(out / "tb"), purge_step=step or None)
    bar = None
    if progress and env.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, unit="step", dynamic_ncols=True, desc=f"train {model_cfg.attn}")

    rows_per_rank = cfg.batch_size // env.world
    micro = rows_per_rank // accum
    last_state = state
    seg_tokens, seg_time = 0, 0.0  # throughput since the last eval (training time only)
    run_time, run_tokens = 0.0, 0  # this process's throughput, for TrainResult

    def evaluate() -> dict[str, float]:
        fwd.eval()
        with torch.no_grad(), autocast:
            scores = task.evaluate(fwd, batch_size=cfg.val_batch_size, max_batches=cfg.eval_batches)
        fwd.train()
        return {k: float(v) for k, v in scores.items()}

    def log_row(scores: dict[str, float], lr: float) -> None:
        nonlocal loss_sum, loss_n, seg_tokens, seg_time
        tokens = step * tokens_per_step if step else 0
        row = {
            "step": step,
            "tokens": tokens,
            "train_loss": loss_sum / loss_n if loss_n else None,
            **{k: v for k, v in scores.items()},
            "lr": lr,
            "tokens_per_s": seg_tokens / seg_time if seg_time > 0 else None,
            "elapsed_s": elapsed,
        }
        rows.append(row)
        loss_sum, loss_n, seg_tokens, seg_time = 0.0, 0, 0, 0.0
        if env.main:
            with open(out / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")
            if tb is not None:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        tb.add_scalar(k, v, step)
            if bar is not None:
                bar.write(f"step {step}: " + " ".join(f"{k} {v:.4g}" for k, v in scores.items()))

    def save() -> dict[str, Any]:
        full_w, full_o = D.full_state(raw, optimizer, sharded)
        rng = D.all_gather_object(env, _rng_state(env))
        st = {
            "step": step,
            "tokens": step * tokens_per_step,
            "metrics": rows,
            "loss_sum": loss_sum,
            "loss_n": loss_n,
            "elapsed_s": elapsed,
            "rng": rng,
            "data_position": {"next_step": step},
            "params": params,
            "world_size": env.world,
            "metric": task.metric,
            "higher_is_better": task.higher_is_better,
            "task": task.describe(),
            "train_config": cfg.to_dict(),
        }
        if env.main:
            ck.save_checkpoint(out, ck.untie(full_w, tied), full_o, model_cfg, kind, st)
        D.barrier(env)
        return json.loads(json.dumps(st))  # a snapshot: rows keeps growing

    raw.train()
    tokens_per_step = _tokens(task.batch(step, cfg.batch_size, cfg.seed)[0])
    if step == 0 and not rows:
        log_row(evaluate(), lr_at(0, lr=cfg.lr, min_lr=cfg.final_lr, warmup=cfg.warmup_steps, total=cfg.max_steps))

    while step < cfg.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, lr=cfg.lr, min_lr=cfg.final_lr, warmup=cfg.warmup_steps, total=cfg.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = task.batch(step, cfg.batch_size, cfg.seed)
        lo = env.rank * rows_per_rank
        x, y = x[lo : lo + rows_per_rank], y[lo : lo + rows_per_rank]  # this rank's slice of the global batch
        step_loss = torch.zeros((), device=env.device)
        for i in range(accum):
            xb = x[i * micro : (i + 1) * micro].to(env.device, non_blocking=True)
            yb = y[i * micro : (i + 1) * micro].to(env.device, non_blocking=True)
            with D.grad_sync(train_fwd, i == accum - 1), autocast:
                loss = task.loss(train_fwd, xb, yb) / accum
            loss.backward()
            step_loss += loss.detach().float()
        loss_val = D.mean(env, step_loss).item()
        if not math.isfinite(loss_val):
            where = (
                f"last good checkpoint: {out / ck.CHECKPOINT} (step {last_state['step']})"
                if last_state
                else "no checkpoint was written"
            )
            raise TrainingDiverged(
                f"loss is {loss_val} at step {step + 1} (lr {lr:.3g}); stopped, {where}; "
                f"try a lower --lr or longer --warmup-steps"
            )
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_sum += loss_val
        loss_n += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        seg_time += dt
        seg_tokens += tokens_per_step
        run_time += dt
        run_tokens += tokens_per_step
        if bar is not None:
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{seg_tokens / max(seg_time, 1e-9):,.0f}", refresh=False)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            log_row(evaluate(), lr)
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps:
            last_state = save()

    if bar is not None:
        bar.close()
    if tb is not None:
        tb.close()
    if env.main:
        task.save_artifacts(out)  # before the final model: a finished run always has them
        _finish(out, out / ck.CHECKPOINT, cfg, last_state)
    D.barrier(env)
    return _result(out, cfg, last_state, run_tokens / run_time if run_time > 0 else 0.0)


def _tokens(x: torch.Tensor) -> int:
    """Tokens in a global batch: B*T for token ids, else one per example (images, sets)."""
    if x.dim() >= 2 and not x.is_floating_point():
        return x.shape[0] * x.shape[1]
    return x.shape[0]
