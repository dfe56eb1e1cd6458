"""What `qkvlab retrofit` reads: the method's options (`RetrofitOptions`, what a report records) and the command's
(`RetrofitConfig`: where from and where to), with every rule across options checked before a model is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qkvlab.base.devices import DEVICE_HELP, TRAIN_DTYPES, check_device, check_dtype, dtype_choices
from qkvlab.base.errors import UserError
from qkvlab.base.model_files import read_json
from qkvlab.base.settings import check, seed_setting, setting
from qkvlab.model.folder import is_model_folder, read_config
from qkvlab.model.spec import select_layers
from qkvlab.retrofit.fit import POOLS, STARTS, check_target
from qkvlab.retrofit.refine import REFINE_INPUTS
from qkvlab.tasks.distill import check_loss_weights

# options added after fits were written without them, and the value that says what those fits did
FITS_BEFORE_THE_OPTION = {"refine_inputs": "original", "rope_dim": None}


@dataclass
class RetrofitOptions:
    # resumable=True: a field the fit does not read, so --resume reuses OUT/fit when only those differ (the
    # uptraining's own run folder still refuses what its training loop cannot resume)
    to: str = setting("Q-K=V", help="target scheme: Q-K=V, or Q-K-V with --kv-heads (plain GQA/MQA)", metavar="SCHEME")
    kv_heads: int | None = setting(
        None, help="key/value heads after pooling (GQA; 1: MQA; default: unchanged)", minimum=1
    )
    kv_latent: int | None = setting(
        None,
        help="with --to Q-K-V: every layer caches a latent of this many numbers per token, its keys and values "
        "read back from it (a joint low-rank fit; docs/retrofit.md)",
        minimum=1,
    )
    rope_dim: int | None = setting(
        None,
        help="with --kv-latent: Multi-head Latent Attention, a RoPE key of this many numbers shared by every head "
        "cached beside the latent (RoRoPE keeps the original frequencies; docs/retrofit.md)",
        minimum=2,
    )
    layers: str | None = setting(
        None,
        help="layers to convert: 'every4', '0,5,7', '-4:' (default: all, or as --cache-budget picks)",
        metavar="SEL",
    )
    cache_budget: float | None = setting(
        None,
        help="convert the layers with the lowest output error after the fit until the KV cache is at most this fraction",
        metavar="F",
        positive=True,
        maximum=1,
    )
    pool: str = setting("fit", help="value heads: least-squares fit folded into out_proj, or plain mean", choices=POOLS)
    start: str = setting(
        "keys",
        help="K=V's shared tensor starts as the keys (exact rotary) or the mean of keys and values",
        choices=STARTS,
    )
    refine_steps: int = setting(
        150, help="Adam steps per converted layer on the original layer's attention output (0: none)", minimum=0
    )
    refine_lr: float = setting(1e-3, help="refinement peak learning rate (cosine to 0)", positive=True)
    refine_inputs: str = setting(
        "converted",
        help="refine each layer on the original model's inputs only, or then again, in order, on the inputs it reads "
        "in the converted model",
        choices=REFINE_INPUTS,
    )
    data: str | None = setting(
        None,
        help="text: a path, 'shakespeare[:genres]', 'hf:NAME?split=..', or several joined by '+' (default Shakespeare)",
        metavar="SOURCE",
    )
    heldout_fraction: float = setting(
        0.1, help="last fraction of every document held out for perplexity, in (0, 1)", positive=True
    )
    calib_tokens: int = setting(
        8192, help="calibration tokens for the fit and refinement (random windows of the training text)", minimum=1
    )
    eval_tokens: int = setting(8192, help="held-out tokens scored for perplexity", minimum=1, resumable=True)
    block_size: int | None = setting(None, help="window length (default min(context, 256))", metavar="T", minimum=1)
    steps: int = setting(200, help="uptraining steps (0: fit only)", minimum=0, resumable=True)
    batch_size: int = setting(8, help="uptraining sequences per step", minimum=1, resumable=True)
    lr: float = setting(3e-4, help="uptraining peak learning rate (cosine to lr/10)", positive=True, resumable=True)
    warmup_steps: int = setting(20, help="uptraining warmup steps", minimum=0, resumable=True)
    kl_weight: float = setting(
        1.0, help="weight of KL(teacher || student) on logits, temperature 1", minimum=0, resumable=True
    )
    lm_weight: float = setting(1.0, help="weight of the LM loss (0: pure distillation)", minimum=0, resumable=True)
    train: str = setting(
        "converted",
        help="what uptraining trains: the converted layers' attention weights, or every weight",
        choices=("converted", "all"),
        resumable=True,
    )
    rest_lr: float | None = setting(
        None,
        help="with --train converted: every other weight trains too, at this peak lr (default a tenth of --lr; "
        "0: they stay frozen)",
        minimum=0,
        resumable=True,
    )
    eval_every: int = setting(
        50, help="uptraining steps between evaluations and checkpoints", minimum=1, resumable=True
    )
    eval_batches: int = setting(10, help="validation batches per uptraining evaluation", minimum=1, resumable=True)
    seed: int = seed_setting(0, help="calibration windows, refinement and uptraining batch order")
    device: str = setting(
        "auto", help=f"device for calibration and uptraining: {DEVICE_HELP}", metavar="DEVICE", resumable=True
    )
    dtype: str = setting(
        "auto",
        help="uptraining autocast dtype (auto: bf16 on CUDA; on the CPU as the timing probe decides)",
        choices=dtype_choices(TRAIN_DTYPES),
        resumable=True,
    )

    def validate(self) -> RetrofitOptions:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        if not self.heldout_fraction < 1:
            raise UserError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.steps:  # the uptraining's distill task would refuse them only after the fit
            check_loss_weights(self.kl_weight, self.lm_weight, "nothing to uptrain on (or --steps 0: fit only)")
        if self.rest_lr and self.train == "all":
            raise UserError(
                f"--rest-lr {self.rest_lr} is for --train converted (--train all trains every weight at --lr)"
            )
        if self.rest_lr is None:  # decided by measurement: docs/results/retrofit, "a tenth of the rate"
            self.rest_lr = self.lr / 10 if self.train == "converted" else 0.0
        if self.layers is not None and self.cache_budget is not None:
            raise UserError("give --layers or --cache-budget, not both (the budget chooses the layers)")
        if self.kv_latent is not None:
            if self.to != "Q-K-V":
                raise UserError(
                    f"--kv-latent {self.kv_latent} with --to {self.to}: a latent keeps the query and replaces separate "
                    "keys and values; give --to Q-K-V"
                )
            extra = [f for f in ("kv_heads", "layers", "cache_budget") if getattr(self, f) is not None]
            if extra:
                flags = ", ".join("--" + f.replace("_", "-") for f in extra)
                raise UserError(f"--kv-latent {self.kv_latent} with {flags}: a latent is one rank for every layer")
        elif self.rope_dim is not None:
            raise UserError(
                f"--rope-dim {self.rope_dim} needs --kv-latent R: it is the RoPE part of Multi-head Latent Attention"
            )
        check_target(self.to, self.pool, self.cache_budget)  # before any model is loaded
        check_dtype(self.dtype, TRAIN_DTYPES)
        check_device(self.device)
        return self


def check_layers(shape: tuple[int, int] | None, opts: RetrofitOptions) -> None:
    """--layers and --kv-heads against the source's (n_layer, n_head), before any weight is read or
    any perplexity measured."""
    if shape is None:
        return
    n_layer, n_head = shape
    if opts.layers is not None:
        select_layers(opts.layers, n_layer)
    if opts.kv_heads is not None and n_head % opts.kv_heads:
        raise UserError(f"--kv-heads {opts.kv_heads} must divide n_head={n_head}")


def source_shape(path: str | Path) -> tuple[int, int] | None:
    """(n_layer, n_head) from the source's config alone; None where only the weights say (.gguf)."""
    path = Path(path)
    if is_model_folder(path):
        cfg = read_config(path)[0]
        return cfg.n_layer, cfg.n_head
    try:  # as data (qkvlab.base.model_files): the loader refuses what is wrong with it, in one line
        body = read_json(path, "config.json", missing_ok=True) if path.is_dir() else None
    except UserError:
        return None
    if body is None:
        return None
    n_layer = body.get("num_hidden_layers", body.get("n_layer"))
    n_head = body.get("num_attention_heads", body.get("n_head"))
    return (n_layer, n_head) if isinstance(n_layer, int) and isinstance(n_head, int) else None


@dataclass
class RetrofitConfig(RetrofitOptions):
    """`qkvlab retrofit`'s command line: the method's options plus where from and where to."""

    input: str = setting(
        help="qkvlab model folder, or a Hugging Face GPT-2/Llama folder or .gguf", positional=True, metavar="IN"
    )
    output: str = setting(
        help="folder to write (new or empty, or a retrofit to --resume)", positional=True, metavar="OUT"
    )
    resume: bool = setting(False, help="continue the uptraining in OUT")
    json: bool = setting(False, help="print the report as JSON before the last line")
    quiet: bool = setting(False, help="no progress output")

    def options(self) -> RetrofitOptions:
        """The method's part (what the report records)."""
        return RetrofitOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RetrofitOptions)})
