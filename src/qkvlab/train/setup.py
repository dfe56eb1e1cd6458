"""A run as the training loop starts it: what is fixed for the whole run (`Run`: config, place,
task, model raw and wrapped, optimizer, autocast) and what changes (`State`), made fresh (`setup`,
`start`) or from a checkpoint (`restore`), after memory bounds are checked (`check_memory`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qkvlab.base.devices import TRAIN_DTYPES, torch_dtype
from qkvlab.base.errors import UserError
from qkvlab.base.heap import hold_freed_memory
from qkvlab.decode.dtype_probe import Decision
from qkvlab.model.config import ModelConfig
from qkvlab.model.folder import tied_aliases, with_aliases
from qkvlab.model.limits import check_training
from qkvlab.tasks import task_from_config
from qkvlab.tasks.base import Task
from qkvlab.train import checkpoint as ck
from qkvlab.train import distributed as D
from qkvlab.train.config import TrainConfig
from qkvlab.train.optim import make_optimizer
from qkvlab.train.run_folder import Saved


@dataclass
class Run:
    """What is fixed for the whole run: config, place, task, model (raw and wrapped), optimizer."""

    cfg: TrainConfig
    out: Path
    env: D.Env
    task: Task
    model_cfg: ModelConfig
    raw: nn.Module  # the model itself: checkpoints, grad clipping
    fwd: nn.Module  # raw, compiled if asked: evaluation (and the FSDP forward)
    train_fwd: nn.Module  # fwd, DDP-wrapped when replicating: the training forward
    optimizer: torch.optim.Optimizer
    autocast: Any  # a context manager
    train_dtype: str  # what cfg.dtype resolved to here: "fp32" (no autocast) or the autocast dtype
    dtype_probe: dict[str, Any] | None  # the CPU timing that decided "auto" (None: not auto, or not a CPU)
    dtype_note: str | None  # that decision in one line, printed at the start
    sharded: bool
    aliases: dict[str, str]  # tied parameter names (qkvlab.model.folder.tied_aliases)
    params: int
    accum: int  # micro-batches per rank per step
    tokens_per_step: int = 0


@dataclass
class State:
    """What changes: step, metrics rows, running sums. The checkpointed fields resume the run."""

    step: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    loss_sum: float = 0.0  # training loss since the last evaluation
    loss_n: int = 0
    elapsed: float = 0.0  # training seconds over the whole run (checkpointed)
    seg_tokens: int = 0  # throughput since the last evaluation (training time only)
    seg_time: float = 0.0
    run_tokens: int = 0  # this process's throughput, for TrainResult
    run_time: float = 0.0
    last_checkpoint: dict[str, Any] | None = None  # state.json of the last checkpoint written or read


def resolve_dtype(
    cfg: TrainConfig, env: D.Env, saved_state: dict[str, Any] | None, decided: tuple | None = None
) -> tuple[str, Decision | None]:
    """The run's autocast dtype. A run resumed where "auto" was timed keeps the dtype it started in
    (a resume continues the same computation); `decided` ((dtype, Decision), what the caller resolved
    "auto" to, as compare does once for all its runs) is taken as it is; otherwise rank 0 decides (on the
    CPU by timing, decode.dtype_probe: ranks timing at once would disturb each other) and every rank
    takes its word."""
    st = saved_state or {}
    if cfg.dtype == "auto" and env.device.type == "cpu" and st.get("train_dtype") in TRAIN_DTYPES:
        try:
            kept = Decision(**{**(st.get("dtype_probe") or {}), "source": "kept from the checkpoint"})
        except TypeError:  # no record (checkpoints before the probe) or another layout
            kept = None
        return st["train_dtype"], kept
    if decided is not None and cfg.dtype == "auto":
        return decided
    decided = cfg.autocast(env.device.type) if env.main else None
    return D.all_gather_object(env, decided)[0] if env.distributed else decided


def setup(
    cfg: TrainConfig, out: Path, env: D.Env, saved_state: dict[str, Any] | None = None, decided: tuple | None = None
) -> Run:
    """Task (ranks never tokenize: `qkvlab prepare` did), model, optimizer, wrappers; `decided`: the dtype
    "auto" resolved to by the caller (resolve_dtype)."""
    task = task_from_config(cfg)
    model_cfg = task.adapt_config(cfg.model)
    check_memory(cfg, model_cfg, env, with_vocab=True)
    if env.device.type == "cpu":
        hold_freed_memory()  # each step reuses the last one's pages instead of faulting in new ones
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    raw = task.build_model(model_cfg).to(env.device)
    aliases = tied_aliases(raw)
    params = sum(p.numel() for p in raw.parameters())
    sharded = env.distributed and cfg.sharding == "fsdp"
    train_dtype, probe = resolve_dtype(cfg, env, saved_state, decided)
    dtype = torch_dtype(train_dtype)
    if sharded:  # blocks compiled one by one before sharding; bf16 all-gathers, fp32 reduction
        D.shard(raw, env, param_dtype=dtype if dtype != torch.float32 else None, compile=cfg.compile)
    optimizer = make_optimizer(raw, cfg.lr, cfg.weight_decay, cfg.betas, env.device, task.lr_scale)
    fwd = torch.compile(raw) if cfg.compile and not sharded else raw
    train_fwd = D.replicate(fwd, env) if env.distributed and cfg.sharding == "ddp" else fwd
    autocast = torch.autocast(env.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    return Run(
        cfg=cfg,
        out=out,
        env=env,
        task=task,
        model_cfg=model_cfg,
        raw=raw,
        fwd=fwd,
        train_fwd=train_fwd,
        optimizer=optimizer,
        autocast=autocast,
        train_dtype=train_dtype,
        dtype_probe=probe.record() if probe is not None else None,
        dtype_note=probe.describe() if probe is not None else None,
        sharded=sharded,
        aliases=aliases,
        params=params,
        accum=cfg.accum_steps(env.world),
    )


def check_memory(cfg: TrainConfig, model_cfg: ModelConfig, env: D.Env, *, with_vocab: bool) -> None:
    """Refuse, before allocating, what cannot fit (qkvlab.model.limits). Without the task's vocabulary
    (before the tokenizer exists) the bound leaves the embeddings and logits out."""
    # lm and distill train on block_size windows when set; other tasks are bounded at the model context
    seq = getattr(cfg.task_settings, "block_size", None) or model_cfg.context
    micro = cfg.batch_size // env.world // cfg.accum_steps(env.world)
    shards = env.world if env.distributed and cfg.sharding == "fsdp" else 1
    sized = model_cfg if with_vocab else model_cfg.replace(vocab_size=1)
    check_training(sized, micro_batch=max(1, micro), seq_len=seq, shards=shards, device=env.device)


def start(run: Run) -> State:
    torch.manual_seed(ck.derived_seed(run.cfg.seed, 0, run.env.rank))  # per-rank dropout streams
    return State()


def restore(run: Run, saved: Saved) -> State:
    """Weights, optimizer state and RNG streams from a checkpoint; the State it recorded."""
    st = saved.state
    error = None
    if run.env.main or not run.sharded:  # under FSDP rank 0 alone read the tensors, and checks them
        try:
            ck.check_against_model(saved.weights, saved.optimizer, run.raw, run.aliases, run.out / ck.CHECKPOINT)
        except UserError as e:
            error = e
    verdict = D.all_gather_object(run.env, None if error is None else str(error))[0] if run.sharded else None
    if error is not None or verdict is not None:
        raise error or UserError(verdict)
    weights = with_aliases(saved.weights, run.aliases) if saved.weights else {}
    D.load_full_state(run.raw, run.optimizer, weights, saved.optimizer, run.sharded, from_rank0=run.sharded)
    rngs = st["rng"]
    if len(rngs) == run.env.world:
        ck.set_rng_state(run.env.device, rngs[run.env.rank])
    else:  # another world size: dropout streams cannot continue; re-derive them
        torch.manual_seed(ck.derived_seed(run.cfg.seed, st["step"], run.env.rank))
    return State(
        step=st["step"],
        rows=st["metrics"],
        loss_sum=st["loss_sum"],
        loss_n=st["loss_n"],
        elapsed=st["elapsed_s"],
        last_checkpoint=st,
    )
