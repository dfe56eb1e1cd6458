"""The training loop: any task, any scheme, one process or many; resumable bit for bit.

Determinism is the design: a step's batch is a function of (seed, step) (tasks/base.py), the
learning rate a function of the step, and the checkpoint holds weights, optimizer state, per-rank
RNG states and every metrics row so far. Resuming from it replays the remaining steps exactly, so
a run killed at any moment and resumed ends with the same weights and metrics.jsonl values as an
uninterrupted one (CPU, same world size); only the timing fields tokens_per_s and elapsed_s differ.

Reading order: `train` -> `_train` (the loop, top to bottom) -> the step, evaluation, checkpoint
and logging functions it calls. What is fixed for a run is a `Run`, what changes a `State`; both
are made in train/setup.py. The loop keeps the resume, divergence and checkpoint-safety rules next
to the step they protect, each a named function.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.devices import torch_dtype
from qkvlab.base.errors import NoRoom, UserError, as_user_error
from qkvlab.base.files import atomic_write, finite_row, json_text
from qkvlab.base.folders import Claim
from qkvlab.base.settings import resolve
from qkvlab.model.folder import METRICS, drop_aliases
from qkvlab.tasks import task_from_config
from qkvlab.train import checkpoint as ck
from qkvlab.train import distributed as D
from qkvlab.train.config import TrainConfig
from qkvlab.train.optim import lr_at
from qkvlab.train.progress import Log
from qkvlab.train.run_folder import claim_run_folder, read_checkpoint, write_train_config
from qkvlab.train.setup import Run, State, check_memory, restore, setup, start

TEST_SCORES = "test.json"  # the final weights on the task's held-out test split (Task.test)
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
    train_dtype: str | None = None  # the autocast dtype it trained in (its dtype setting, resolved); None: not recorded


def train(
    cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False, progress: bool = True, decided: tuple | None = None
) -> TrainResult:
    """Train `cfg` into `out_dir` (see module doc). With resume=True: continue from OUT's last
    complete checkpoint, start fresh if there is none, return at once if it is already finished.
    decided: (dtype, Decision) that "auto" resolves to, when the caller decided it (setup.resolve_dtype).
    OUT is locked while this runs (qkvlab.base.folders); a refusal leaves it as it was. Under torchrun
    the process group is set up (and torn down) here."""
    cfg = resolve(TrainConfig, cfg)  # validated private copy
    if cfg.log_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("log_tensorboard needs TensorBoard: pip install 'qkvlab[tb]'")
    out = Path(out_dir)
    env = D.setup(cfg.device, cfg.dist_timeout_s)
    claim = None
    try:
        check_memory(cfg, cfg.model, env, with_vocab=False)  # before anything is written or built
        claim = claim_run_folder(out, env, resume)
        return _train(cfg, out, env, resume, progress, claim, decided)
    except Exception as e:
        err = as_user_error(e)  # a full disk or an unwritable folder (the cache, OUT) is refused like bad input
        if err is None:
            raise
        if claim is not None:
            claim.undo()  # a refused run leaves OUT as it found it (its last checkpoint, if it has one)
            err = how_to_continue(err, out, resume, wrote_checkpoint=claim.keep)
        if err is e:
            raise
        raise err from None
    finally:
        if claim is not None:
            claim.release()
        D.teardown(env)


def how_to_continue(err: UserError, out: Path, resume: bool, *, wrote_checkpoint: bool) -> UserError:
    """A run stopped by `err` after OUT was claimed, with the command that continues it: a full disk
    always says it (`--resume` when OUT holds a checkpoint now: a plain re-run is refused then);
    another fault only when this process wrote the checkpoint."""
    step = ck.checkpoint_step(out)
    resume_it = "run the same command again" if resume else f"run `qkvlab train --out {out} --resume`"
    if isinstance(err, NoRoom):
        if step is None:
            return err.then("run the same command again (no checkpoint was kept, so it starts afresh)")
        return err.then(f"{resume_it} (it continues from the checkpoint at step {step})")
    if wrote_checkpoint and not resume and step is not None:
        return UserError(f"{err}; `qkvlab train --out {out} --resume` continues from its checkpoint at step {step}")
    return err


def _train(
    cfg: TrainConfig, out: Path, env: D.Env, resume: bool, progress: bool, claim: Claim | None, decided: tuple | None
) -> TrainResult:
    saved = read_checkpoint(cfg, out, env, resume)  # verified, or refused before anything is written
    if env.main:  # before any step, so a resume after a kill at any moment trains this run's config
        write_train_config(out, cfg)
    if saved is not None and saved.state["step"] == cfg.max_steps and not _test_scores_missing(cfg, out):
        return _republish(cfg, out, env, saved.state)
    run = setup(cfg, out, env, saved.state if saved is not None else None, decided)
    if run.dtype_note and env.main and progress:
        print(run.dtype_note, flush=True)
    state = restore(run, saved) if saved is not None else start(run)
    del saved
    if env.main:
        _write_metrics(out, state.rows)  # truncates rows written after the checkpoint
    log = Log.open(
        step=state.step,
        max_steps=cfg.max_steps,
        log_every=cfg.log_every,
        desc=f"train {run.model_cfg.attn}",
        bar=env.main and progress,
        tb_dir=out / "tb" if env.main and cfg.log_tensorboard else None,
    )

    run.raw.train()
    run.tokens_per_step = _tokens(run.task.batch(state.step, cfg.batch_size, cfg.seed)[0])
    try:
        if state.step == 0 and not state.rows:
            log_evaluation(run, state, log, evaluate(run), lr_for(cfg, 0))
        while state.step < cfg.max_steps:
            lr = lr_for(cfg, state.step)
            loss = train_step(run, state, lr)
            if not math.isfinite(loss):
                raise _diverged(run, state, f"loss is {loss} at step {state.step + 1} (lr {lr:.3g})")
            log.step(state.step, loss, state.seg_tokens / max(state.seg_time, 1e-9))
            if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps:
                log_evaluation(run, state, log, evaluate(run), lr)
            if state.step % cfg.ckpt_every == 0 or state.step == cfg.max_steps:
                state.last_checkpoint = save_checkpoint(run, state)
                if claim is not None:
                    claim.keep = True  # from here on OUT holds work worth keeping, whatever happens
    except BaseException:
        log.close()  # the bar ends its line, so a one-line error starts on its own
        raise
    log.close()

    scored = score_test(run)
    if env.main:
        run.task.save_artifacts(out)  # before the final model: a finished run always has them
        if scored is not None:
            atomic_write(out / TEST_SCORES, json_text(scored, indent=2))
        ck.write_final_model(out, state.last_checkpoint, cfg.to_dict())
    D.barrier(env)
    tokens_per_s = state.run_tokens / state.run_time if state.run_time > 0 else 0.0
    return _result(out, state.last_checkpoint, tokens_per_s)


# ---- the step and evaluation ---------------------------------------------------------------------
def lr_for(cfg: TrainConfig, step: int) -> float:
    return lr_at(step, lr=cfg.lr, min_lr=cfg.final_lr, warmup=cfg.warmup_steps, total=cfg.decay_steps)


def train_step(run: Run, state: State, lr: float) -> float:
    """One optimizer step on this rank's slice of the step's global batch; returns the loss (mean
    over ranks). A non-finite loss returns before the update, leaving the weights as they were."""
    cfg, env = run.cfg, run.env
    t0 = time.perf_counter()
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # a checkpoint from before scales has none
    x, y = run.task.batch(state.step, cfg.batch_size, cfg.seed)
    rows_per_rank = cfg.batch_size // env.world
    micro = rows_per_rank // run.accum
    lo = env.rank * rows_per_rank
    x, y = x[lo : lo + rows_per_rank], y[lo : lo + rows_per_rank]  # this rank's slice of the global batch
    step_loss = torch.zeros((), device=env.device)
    for i in range(run.accum):
        xb = x[i * micro : (i + 1) * micro].to(env.device, non_blocking=True)
        yb = y[i * micro : (i + 1) * micro].to(env.device, non_blocking=True)
        with D.grad_sync(run.train_fwd, i == run.accum - 1), run.autocast:
            loss = run.task.loss(run.train_fwd, xb, yb) / run.accum
        loss.backward()
        step_loss += loss.detach().float()
    loss_val = D.mean(env, step_loss).item()
    if not math.isfinite(loss_val):
        return loss_val
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.raw.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    state.step += 1
    state.loss_sum += loss_val
    state.loss_n += 1
    state.elapsed += dt
    state.seg_time += dt
    state.seg_tokens += run.tokens_per_step
    state.run_time += dt
    state.run_tokens += run.tokens_per_step
    return loss_val


def evaluate(run: Run) -> dict[str, float]:
    """The task's validation scores, in eval mode without gradients."""
    run.fwd.eval()
    with torch.no_grad(), run.autocast:
        shard = {"shard": run.env} if run.env.distributed and getattr(run.task, "shards_evaluation", False) else {}
        scores = run.task.evaluate(
            run.fwd, batch_size=run.cfg.val_batch_size, max_batches=run.cfg.eval_batches, **shard
        )
    run.fwd.train()
    return {k: float(v) for k, v in scores.items()}


def score_test(run: Run) -> dict[str, Any] | None:
    """The task's held-out test scores of the final weights (every rank runs the same forwards)."""
    run.fwd.eval()
    with torch.no_grad(), run.autocast:
        scored = run.task.test(run.fwd, batch_size=run.cfg.val_batch_size)
    run.fwd.train()
    dtype = str(torch_dtype(run.train_dtype)).removeprefix("torch.")  # what the scoring forward ran in
    return None if scored is None else {**scored, "step": run.cfg.max_steps, "dtype": dtype}


def _diverged(run: Run, state: State, what: str) -> TrainingDiverged:
    """The one-line error naming the last good checkpoint: one whose training losses, weights and
    (when evaluated at its step) validation scores were all finite."""
    last = state.last_checkpoint
    where = (
        f"last good checkpoint: {run.out / ck.CHECKPOINT} (step {last['step']})"
        if last
        else "no checkpoint was written"
    )
    return TrainingDiverged(f"{what}; stopped, {where}; try a lower --lr or longer --warmup-steps")


def log_evaluation(run: Run, state: State, log: Log, scores: dict[str, float], lr: float) -> None:
    """Append a metrics row (every rank keeps the rows; rank 0 writes them) and reset the sums."""
    row = {
        "step": state.step,
        "tokens": state.step * run.tokens_per_step if state.step else 0,
        "train_loss": state.loss_sum / state.loss_n if state.loss_n else None,
        **scores,
        "lr": lr,
        "tokens_per_s": state.seg_tokens / state.seg_time if state.seg_time > 0 else None,
        "elapsed_s": state.elapsed,
    }
    row = finite_row(row)
    state.rows.append(row)
    state.loss_sum, state.loss_n, state.seg_tokens, state.seg_time = 0.0, 0, 0, 0.0
    if run.env.main:
        with open(run.out / METRICS, "a") as f:
            f.write(json_text(row))
        log.row(row, scores)
    if row.get("nonfinite"):
        bad = row["nonfinite"][0]
        raise _diverged(run, state, f"{bad} is {scores.get(bad, bad)} at step {state.step}")


def _write_metrics(out: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write(out / METRICS, "".join(json_text(r) for r in rows))


# ---- checkpoints and the final model ----------------------------------------------------------
def save_checkpoint(run: Run, state: State) -> dict[str, Any]:
    """Write OUT/checkpoint (a collective under FSDP); returns a snapshot of its state.json."""
    env = run.env
    weights, optim_state = D.full_state(run.raw, run.optimizer, run.sharded, main=env.main)  # rank 0's alone
    bad = next((k for k, t in weights.items() if not torch.isfinite(t).all()), None) if env.main else None
    bad = D.all_gather_object(env, bad)[0]
    if bad is not None:  # never write a checkpoint that is not good
        raise _diverged(run, state, f"weight {bad} is not finite after step {state.step}")
    st = {
        "step": state.step,
        "tokens": state.step * run.tokens_per_step,
        "metrics": state.rows,
        "loss_sum": state.loss_sum,
        "loss_n": state.loss_n,
        "elapsed_s": state.elapsed,
        "rng": D.all_gather_object(env, ck.rng_state(env.device)),
        "data_position": {"next_step": state.step},
        "params": run.params,
        "world_size": env.world,
        "metric": run.task.metric,
        "higher_is_better": run.task.higher_is_better,
        "task": run.task.describe(),
        "train_config": run.cfg.to_dict(),
        "train_dtype": run.train_dtype,
        "dtype_probe": run.dtype_probe,
    }
    if env.main:
        ck.save_checkpoint(
            run.out, drop_aliases(weights, run.aliases), optim_state, run.model_cfg, run.task.model_kind, st
        )
    D.barrier(env)
    return json.loads(json.dumps(st))  # a snapshot: rows keeps growing


def _test_scores_missing(cfg: TrainConfig, out: Path) -> bool:
    """A finished run killed after its last checkpoint but before test.json: it goes the whole way (no
    step left to train), which scores it, instead of being republished without scores. A task without
    a test split (distill) never has them to miss, and is republished without building anything."""
    return not (out / TEST_SCORES).is_file() and task_from_config(cfg).has_test_split


def _republish(cfg: TrainConfig, out: Path, env: D.Env, st: dict[str, Any]) -> TrainResult:
    """A finished run: (re)publish the final model and metrics, no training."""
    if env.main:
        _write_metrics(out, st["metrics"])
        ck.write_final_model(out, st, cfg.to_dict())
    D.barrier(env)
    timed = [r["tokens_per_s"] for r in st["metrics"] if r.get("tokens_per_s")]
    return _result(out, st, sum(timed) / len(timed) if timed else 0.0)  # as recorded


def _result(out: Path, st: dict[str, Any], tokens_per_s: float) -> TrainResult:
    rows = st["metrics"]
    return TrainResult(
        out_dir=out,
        step=st["step"],
        tokens=st["tokens"],
        metrics=rows[-1] if rows else {},
        history=rows,
        params=st["params"],
        tokens_per_s=tokens_per_s,
        metric=st.get("metric", "val_loss"),
        higher_is_better=st.get("higher_is_better", False),
        train_dtype=st.get("train_dtype"),  # None in checkpoints written before it was recorded
    )


# ---- helpers ----------------------------------------------------------------------------------
def _tokens(x: torch.Tensor) -> int:
    """Tokens in a global batch: B*T for token ids, else one per example (images, sets)."""
    if x.dim() >= 2 and not x.is_floating_point():
        return x.shape[0] * x.shape[1]
    return x.shape[0]
