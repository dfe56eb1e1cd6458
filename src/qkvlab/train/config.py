"""Training configuration: one dataclass, the papers' recipes as presets, YAML/TOML loading.

Everything is validated up front: an unknown key or a bad value is a one-line `UserError` naming it,
raised before any data is tokenized or any model is built. About 400 lines, most of it the
declared fields (help text each) and the papers' recipes as data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from qkvlab.base.devices import SHARDINGS, TRAIN_DTYPES, check_device, check_dtype, dtype_choices
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, resolve, resumable_fields, seed_setting, setting
from qkvlab.decode.dtype_probe import autocast_dtype
from qkvlab.model.config import ModelConfig
from qkvlab.tasks import resolve_task_options

WEIGHT_DECAY = 0.1  # nanoGPT's, on weights with dim >= 2
IDENTITY_WEIGHT_DECAY = 2**-5  # Paper A's identity models (an identity Q, K or V role)


def default_weight_decay(model: ModelConfig) -> float:
    """The recipe's weight decay for a model when the user sets none."""
    return IDENTITY_WEIGHT_DECAY if model.spec.identity_role else WEIGHT_DECAY


# ---- presets -----------------------------------------------------------------------------------
# Each names a model preset of qkvlab.model.config plus the optimisation recipe; its task options are the
# lm task's (settings.resolve drops them when the run's task is another). The papers' figures are
# in papers.md; their corpora need the network (or a local copy passed with --data).
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    # a few hundred steps in well under a minute on 2 CPU cores (tests and scripts use it)
    "tiny": dict(
        model={"preset": "tiny"},
        task_options={"tokenizer": "bpe:512"},
        max_steps=300,
        batch_size=16,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=30,
        eval_every=50,
        eval_batches=4,
    ),
    # a few minutes on 2 CPU cores
    "small": dict(
        model={"preset": "small"},
        task_options={"tokenizer": "bpe:2048"},
        max_steps=1000,
        batch_size=32,
        lr=2e-3,
        min_lr=2e-4,
        warmup_steps=100,
        eval_every=100,
        eval_batches=8,
    ),
    # Paper A (nanoGPT GPT-2 small on OpenWebText): 480 x 1024 = 491,520 tokens/step. The reference stops
    # at max_iters 105,001 of a cosine whose horizon is lr_decay_iters 600,000: the lr ends near 5.6e-4.
    "gpt2-124m": dict(
        model={"preset": "gpt2-124m"},
        task_options={"data": "hf:Skylion007/openwebtext", "tokenizer": "gpt2"},
        max_steps=105_001,
        lr_decay_steps=600_000,
        batch_size=480,
        micro_batch_size=12,
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=2000,
        betas=(0.9, 0.95),
        grad_clip=1.0,
        eval_every=1000,
        eval_batches=200,
        compile=True,
    ),
    # Paper B 300M on 10B SlimPajama tokens: 1152 x 2048 = 2,359,296 tokens/step, 4,239 steps
    "paperB-300m": dict(
        model={"preset": "paperB-300m"},
        task_options={"data": "hf:cerebras/SlimPajama-627B", "tokenizer": "gpt2"},
        max_steps=4239,
        batch_size=1152,
        micro_batch_size=8,
        lr=2e-4,
        min_lr=2e-5,
        warmup_steps=500,
        betas=(0.9, 0.95),
        grad_clip=1.0,
        eval_every=250,
        eval_batches=100,
        compile=True,
    ),
    # Paper B 1.2B: 576 x 2048 = 1,179,648 tokens/step, 8,478 steps; optimizer state sharded
    "paperB-1.2b": dict(
        model={"preset": "paperB-1.2b"},
        task_options={"data": "hf:cerebras/SlimPajama-627B", "tokenizer": "gpt2"},
        max_steps=8478,
        batch_size=576,
        micro_batch_size=4,
        lr=6e-5,
        min_lr=6e-6,
        warmup_steps=1000,
        betas=(0.9, 0.95),
        grad_clip=1.0,
        eval_every=500,
        eval_batches=100,
        compile=True,
        sharding="fsdp",
    ),
}


@dataclass
class TrainConfig:
    presets: ClassVar[dict[str, dict[str, Any]]] = TRAIN_PRESETS  # what a `preset` key names (settings.resolve)

    task: str = setting("lm", help="task name (lm, reverse, mnist5k, ...)", metavar="NAME")
    task_options: dict[str, Any] = setting(
        help="a task option (repeatable; VALUE read as YAML), e.g. length=64",
        default_factory=dict,
        flag="--task-option",
        metavar="KEY=VALUE",
        follows="task",
    )
    model: ModelConfig = setting(help="model options", default_factory=ModelConfig, group=ModelConfig)
    seed: int = seed_setting(0, help="seed of the initial weights and the data order")
    max_steps: int = setting(1000, help="optimizer steps (may grow on resume)", resumable=True, minimum=1)
    batch_size: int = setting(32, help="global sequences (examples) per optimizer step, over all ranks", minimum=1)
    grad_accum: int = setting(1, help="micro-batches per rank per step", minimum=1)
    micro_batch_size: int | None = setting(
        None,
        help="sequences per micro-batch; then grad_accum = batch_size / (world * micro): any world size",
        minimum=1,
    )
    lr: float = setting(1e-3, help="peak learning rate", positive=True)
    min_lr: float | None = setting(None, help="end of the cosine (default lr / 10)", minimum=0)
    warmup_steps: int = setting(100, help="linear warmup steps", minimum=0)
    lr_decay_steps: int | None = setting(
        None, help="the cosine's horizon, nanoGPT's lr_decay_iters (default max_steps)", metavar="STEPS", minimum=1
    )
    weight_decay: float | None = setting(
        None,
        help=f"AdamW weight decay on weights with dim >= 2 (default {WEIGHT_DECAY}; "
        f"{IDENTITY_WEIGHT_DECAY} for schemes with an identity role, Paper A)",
        minimum=0,
    )
    betas: tuple[float, float] = setting((0.9, 0.95), help="AdamW betas", metavar="B1,B2")
    grad_clip: float = setting(1.0, help="max global grad norm; 0 disables", minimum=0)
    eval_every: int = setting(100, help="steps between evaluations", resumable=True, minimum=1)
    eval_batches: int = setting(10, help="batches per evaluation", minimum=1)
    eval_batch_size: int | None = setting(
        None, help="examples per eval batch (default: the micro-batch size)", minimum=1
    )
    checkpoint_every: int | None = setting(
        None, help="steps between checkpoints (default eval_every)", resumable=True, minimum=1
    )
    compile: bool = setting(False, help="torch.compile the model", resumable=True)
    dtype: str = setting(
        "auto",
        help="autocast dtype (auto: bf16 on CUDA; on the CPU bf16 only where timing this model's shapes here "
        "shows it faster than fp32; fp32 elsewhere)",
        choices=dtype_choices(TRAIN_DTYPES),
    )
    device: str = setting(
        "auto",
        help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:N, mps",
        resumable=True,
        metavar="DEVICE",
    )
    sharding: str = setting(
        "ddp",
        help="ddp: replicate; fsdp: FSDP2 (params, grads, optimizer state sharded)",
        choices=SHARDINGS,
        resumable=True,
    )
    dist_timeout_s: int | None = setting(
        None, help="timeout of the collectives in seconds (default: PyTorch's)", resumable=True, metavar="S", minimum=1
    )
    log_tensorboard: bool = setting(
        False, help="TensorBoard logs in OUT/tb (needs the 'tb' extra)", resumable=True, flags=("--tensorboard",)
    )
    log_every: int = setting(10, help="progress-bar refresh (steps)", resumable=True, minimum=1)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def final_lr(self) -> float:
        return self.min_lr if self.min_lr is not None else self.lr / 10

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.max_steps

    @property
    def ckpt_every(self) -> int:
        return self.checkpoint_every or self.eval_every

    @property
    def task_settings(self) -> Any:
        """The task's options, typed: its module's OPTIONS_CLASS with every default filled, from
        `task_options` (what the user set, the form saved and compared) through the task's one checker."""
        return resolve_task_options(self.task, self.task_options)

    def train_dtype(self, device_type: str) -> str:
        """The dtype this run trains in on `device_type`: its dtype setting resolved (`autocast`)."""
        return self.autocast(device_type)[0]

    def autocast(self, device_type: str):
        """(dtype, Decision or None): the dtype setting resolved on `device_type`, with the CPU timing
        that decided "auto" there (qkvlab.decode.dtype_probe, the one place of the rule)."""
        rows = (self.micro_batch_size or max(1, self.batch_size // self.grad_accum)) * self.model.context
        return autocast_dtype(self.dtype, device_type, self.model, rows)

    def accum_steps(self, world: int) -> int:
        """Micro-batches per rank per step at this world size (checks divisibility)."""
        if self.micro_batch_size is not None:
            per = self.batch_size // world
            if self.batch_size % world or per % self.micro_batch_size:
                raise UserError(
                    f"batch_size={self.batch_size} is not divisible by world size {world} x "
                    f"micro_batch_size={self.micro_batch_size}"
                )
            return per // self.micro_batch_size
        if self.batch_size % (world * self.grad_accum):
            raise UserError(
                f"batch_size={self.batch_size} is not divisible by world size {world} x grad_accum={self.grad_accum}"
            )
        return self.grad_accum

    @property
    def val_batch_size(self) -> int:
        if self.eval_batch_size is not None:
            return self.eval_batch_size
        return self.micro_batch_size or max(1, self.batch_size // self.grad_accum)

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        self.model.validate()
        if self.weight_decay is None:  # resolved here, so saved configs and --print-config show it
            self.weight_decay = default_weight_decay(self.model)
        if not all(0 <= x < 1 for x in self.betas):
            raise UserError(f"betas={list(self.betas)!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        check_dtype(self.dtype, TRAIN_DTYPES)
        check_device(self.device)
        self.accum_steps(1)
        self.task_settings  # noqa: B018 (built to check the task options, before any data is read)
        return self

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_dict()
        d["betas"] = list(self.betas)
        d["task_options"] = dict(self.task_options)
        return json.loads(json.dumps(d))  # plain JSON types only

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Keys of TrainConfig, plus `preset` (a training preset to start from); `model` may be a
        ModelConfig or a mapping of model keys (with an optional model `preset`)."""
        return resolve(cls, data)

    def replace(self, **changes: Any) -> TrainConfig:
        return resolve(TrainConfig, self, changes)


# changing these between a run and its resume keeps the replay exact (or only extends it)
RESUMABLE_FIELDS = resumable_fields(TrainConfig)


def changed_fields(saved: Mapping[str, Any], now: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Fields (not resumable) whose saved value differs from `now`'s: name -> (saved, now's), in
    name order. The saved config is read through TrainConfig first, so keys an older qkvlab did not
    write take today's defaults."""
    try:
        old = TrainConfig.from_dict(saved).to_dict()
    except (UserError, TypeError):
        old = dict(saved)
    new = now.to_dict()
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k), new.get(k)) for k in keys if k not in RESUMABLE_FIELDS and old.get(k) != new.get(k)}


def config_fingerprint(cfg: TrainConfig | Mapping[str, Any]) -> str:
    """16 hex digits of the sha256 of the fields changed_fields compares (max_steps added back): equal
    for a planned run and the saved config of the run it would be, so a run recorded only in a results
    table (its folder gone) can stand for the planned one."""
    try:
        body = (cfg if isinstance(cfg, TrainConfig) else TrainConfig.from_dict(dict(cfg))).to_dict()
    except (UserError, TypeError):
        return ""
    kept = {k: v for k, v in body.items() if k not in RESUMABLE_FIELDS or k == "max_steps"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def train_preset(name: str, **overrides: Any) -> TrainConfig:
    """Deprecated: `TrainConfig.from_dict({"preset": name, **overrides})`, the one resolver."""
    warnings.warn(
        'train_preset is deprecated; use TrainConfig.from_dict({"preset": name, ...})', DeprecationWarning, stacklevel=2
    )
    return resolve(TrainConfig, {"preset": name}, overrides)


@dataclass
class TrainRun:
    """The rest of `qkvlab train`'s command line: where the run goes, which recipe it starts from,
    and the lm task's most used options (they land in TrainConfig.task_options)."""

    config_path: str | None = setting(
        None, help="training config file (same as --config)", positional=True, metavar="CONFIG"
    )
    out: str | None = setting(None, help="run folder (metrics, checkpoint, final model)", metavar="DIR")
    resume: bool = setting(False, help="continue from DIR's last complete checkpoint")
    preset: str | None = setting(None, help="start from a training preset (default: small)", choices=TRAIN_PRESETS)
    data: str | None = setting(
        None,
        help="lm corpus: a path, 'shakespeare[:genres]', 'hf:NAME?split=..', or several joined by '+'",
        metavar="SOURCE",
    )
    tokenizer: str | None = setting(None, help="lm tokenizer: bpe:N, char or gpt2", metavar="SPEC")
    block_size: int | None = setting(
        None, help="lm training window (default: the model context)", metavar="T", minimum=1
    )
    quiet: bool = setting(False, help="no progress bar")

    def task_options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("data", "tokenizer", "block_size") if getattr(self, k) is not None}
