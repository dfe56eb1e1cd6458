"""Training's and inference's `auto` dtype, decided by measurement: the one place the rule lives.

CUDA trains under bf16 autocast. On the CPU whether bf16 autocast pays depends on the chip (AMX
multiplies bf16 several times faster than fp32; AVX512-BF16 without AMX can train slower than fp32) and on the
width (autocast casts every Linear's input and weight at every step), so no CPU flag can decide it.
`cpu_autocast` times a training step (forward and backward) of one block and the head at the
model's width, heads, vocabulary and batch x length, in fp32 and under bf16 autocast (matmuls alone
are not enough: the casts, norms and softmax around them decide it at small widths), and takes bf16
only if it is faster by more than the rounds' own spread. The rounds, the rule, the cache (per
machine and shape class) and when a cached decision is trusted are `qkvlab.base.measured`'s, shared
with the decode layout; the decision and its figures go into the run's record.

Inference's `auto` on the CPU is decided the same way (`cpu_decode_dtype`, `inference_dtype`): a
greedy decode step of the model's own block shape (scheme, heads, MLP) and head, `DECODE_LAYERS`
deep (so the weights leave the CPU's caches, as a real model's do), at the batch sizes it will run,
with fp32 weights (in the decode layout generate would use) against bf16 weights, under "decode-..."
keys. A decode step is not a training step: at batch 1 it reads every weight once (bf16 halves the
bytes), at 16 rows its products are small matrix products (bf16 dot products can pay without AMX;
benchmarks/decode_smollm2.py), so only the measurement can say.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qkvlab.base.devices import dtype_name
from qkvlab.base.errors import UserError
from qkvlab.base.measured import Measured, Timer, Ways, decide, machine_key
from qkvlab.decode.layout import choose_layout, linear_shapes, packed_model
from qkvlab.decode.steps import decode_step, left_pad, new_cache, prefill
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT

# The timed step is capped (sequence length, rows = batch x length): past the caps the ratio no
# longer moves much with size, and the probe stays near a second for any model a CPU trains.
MAX_T = 256
MAX_ROWS = 512


@dataclass(frozen=True)
class ShapeClass:
    """What is timed: one standard block (Q-K-V, a 4d GELU MLP, layer norms) and the head of a
    model of this width, heads and vocabulary, forward and backward on `batch` sequences of `T`.
    Scheme, depth and MLP width are left out, so every variant of one size shares a decision and
    a comparison of schemes never trains one variant in bf16 and another in fp32."""

    d_model: int
    n_head: int
    vocab: int
    T: int
    batch: int

    @classmethod
    def of(cls, model_cfg, rows: int) -> ShapeClass:
        T = max(1, min(model_cfg.context, MAX_T, rows))
        batch = max(1, min(rows, MAX_ROWS) // T)
        return cls(model_cfg.d_model, model_cfg.n_head, model_cfg.vocab_size or 1, T, batch)

    @property
    def key(self) -> str:
        return f"d{self.d_model}-h{self.n_head}-v{self.vocab}-T{self.T}-b{self.batch}"

    def model(self):
        """The block and head that are timed (a GPT of one layer)."""
        base = {"n_layer": 1, "d_model": self.d_model, "vocab_size": self.vocab, "context": self.T}
        try:
            cfg = ModelConfig(n_head=self.n_head, **base).validate()
        except UserError:  # a width the standard block cannot split into these heads: one head
            cfg = ModelConfig(n_head=1, **base).validate()
        return GPT(cfg)


@dataclass(frozen=True)
class Decision:
    """What `auto` resolved to on the CPU and the figures it was decided from (ms per pass)."""

    dtype: str
    fp32_ms: float
    bf16_ms: float
    noise: float  # the relative margin bf16 had to beat
    shape: str
    machine: str
    source: str = "measured now"  # or "cached", or "kept from the checkpoint" (a resumed run)
    step: str = "training"  # what was timed: a training step (autocast) or a decode step (weights)

    @property
    def speedup(self) -> float:
        """bf16 autocast's speed as a multiple of fp32's (above 1: bf16 is faster)."""
        return self.fp32_ms / self.bf16_ms if self.bf16_ms > 0 else 0.0

    def describe(self) -> str:
        what = "bf16 autocast" if self.step == "training" else "bf16 weights"
        return (
            f"dtype auto -> {self.dtype}: {what} {self.speedup:.2f}x fp32 on a {self.step} step of {self.shape} "
            f"({self.bf16_ms:.2f} vs {self.fp32_ms:.2f} ms, noise {self.noise:.0%}; {self.source})"
        )

    @classmethod
    def of(cls, measured: Measured, shape: str, step: str = "training") -> Decision:
        """The Decision of a `measured.decide` record for fp32 against bf16."""
        ms = measured.ms
        return cls(measured.choice, ms["fp32"], ms["bf16"], measured.noise, shape, machine_key(), measured.source, step)

    def record(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "source"}
        if self.step == "training":
            out.pop("step")  # the record training runs have always written
        return out


def training_ways(shape: ShapeClass) -> Ways:
    """One forward + backward step each, fp32 and under bf16 autocast (fp32 weights, as training runs)."""
    torch.manual_seed(0)
    model = shape.model()
    idx = torch.randint(0, shape.vocab, (shape.batch, shape.T))

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(idx, idx)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return {"fp32": lambda: step(False), "bf16": lambda: step(True)}


DECODE_LAYERS = 8  # blocks in the decode probe's model: with its head, more bytes than a CPU's caches hold
DECODE_FILL = 64  # cached tokens per row when a probe step runs


@dataclass(frozen=True)
class DecodeShape:
    """What the decode probe times: `layers` blocks of the model's first layer's shape (scheme, kv
    heads, MLP kind and width) and its head and vocabulary, one greedy token for each of `batch`
    rows at a cache fill of DECODE_FILL."""

    attn: str
    d_model: int
    n_head: int
    kv_heads: int
    mlp: str
    hidden: int
    vocab: int
    layers: int
    batch: int

    @classmethod
    def of(cls, model_cfg, batch: int) -> DecodeShape:
        c = model_cfg.layer_config(0)
        layers = min(model_cfg.n_layer, DECODE_LAYERS)
        return cls(c.attn, c.d_model, c.n_head, c.n_kv_heads, c.mlp, c.hidden, c.vocab_size or 1, layers, batch)

    @property
    def key(self) -> str:
        return (
            f"decode-{self.attn}-d{self.d_model}-h{self.n_head}-kv{self.kv_heads}-{self.mlp}{self.hidden}"
            f"-v{self.vocab}-L{self.layers}-b{self.batch}"
        )

    def config(self, base) -> ModelConfig:
        """`base` (the served model's config) cut to the probe's depth and one scheme."""
        c = base.layer_config(0)
        return c.replace(n_layer=self.layers, context=DECODE_FILL + 1, dropout=0.0)


def decode_ways(shape: DecodeShape, base, timer: Timer = Timer(), cache: Path | None = None) -> Ways:
    """One greedy decode step each (all rows, at DECODE_FILL cached tokens), fp32 weights in the layout
    generate would use for them (`layout.choose_layout`) against bf16 weights."""
    torch.manual_seed(0)
    with torch.device("meta"):  # GPT's own init of a 49k vocabulary takes seconds; timing needs no init
        fp32 = GPT(shape.config(base))
    fp32 = fp32.to_empty(device="cpu").eval()
    for p in fp32.parameters():
        p.detach().normal_(0.0, 0.02)
    for m in fp32.modules():
        if hasattr(m, "build_tables"):  # rotary and position tables
            m.build_tables()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    parts = torch.get_num_threads()
    layout, _ = choose_layout(linear_shapes(fp32), "fp32", "cpu", shape.batch, parts, timer=timer, cache=cache)
    prompts = left_pad(torch.randint(0, shape.vocab, (shape.batch, DECODE_FILL)).tolist())

    def way(model) -> Callable[[], None]:
        cache_ = new_cache(model, shape.batch, DECODE_FILL + 1)
        with torch.inference_mode():
            tok = prefill(model, cache_, prompts).argmax(-1)
        pos = prompts.lengths.clone()

        @torch.inference_mode()
        def step() -> None:
            cache_.length = DECODE_FILL  # rewound: every call decodes the token after the same fill
            decode_step(model, cache_, tok, pos)

        return step

    return {"fp32": way(packed_model(fp32, layout, parts)), "bf16": way(bf16)}


def cpu_autocast(
    model_cfg,
    rows: int,
    *,
    ways: Callable[[ShapeClass], Ways] | None = None,
    timer: Timer = Timer(),
    cache: Path | None = None,
) -> Decision:
    """The CPU's autocast dtype for a model of `model_cfg` at `rows` rows a micro-batch, as
    `measured.decide` gives it (cached, or timed now through `ways`, default `training_ways`)."""
    shape = ShapeClass.of(model_cfg, rows)
    record = decide(shape.key, "fp32", lambda: (ways or training_ways)(shape), timer=timer, path=cache)
    return Decision.of(record, shape.key)


def cpu_decode_dtype(
    model_cfg,
    batches: tuple[int, ...] = (1,),
    *,
    ways: Callable[[DecodeShape], Ways] | None = None,
    timer: Timer = Timer(),
    cache: Path | None = None,
) -> Decision:
    """The CPU's inference dtype for a model of `model_cfg` decoding at each of `batches` rows:
    bf16 weights when bf16 wins at one batch by more than the noise and loses at none by more than
    it; each batch decided by `measured.decide` (through `ways`, default `decode_ways`)."""
    ways = ways or (lambda shape: decode_ways(shape, model_cfg, timer, cache))
    shapes = [DecodeShape.of(model_cfg, b) for b in dict.fromkeys(max(1, int(b)) for b in batches)]
    records = [decide(s.key, "fp32", lambda s=s: ways(s), timer=timer, path=cache) for s in shapes]
    ms = [r.ms for r in records]
    wins = [r.choice == "bf16" for r in records]  # `measured.choose`'s verdict per batch
    losses = [m["bf16"] > m["fp32"] * (1 + r.noise) for m, r in zip(ms, records)]  # its mirror: bf16 slower
    dtype = "bf16" if any(wins) and not any(losses) else "fp32"
    per_token = [(m["fp32"] / s.batch, m["bf16"] / s.batch) for s, m in zip(shapes, ms)]
    source = next((r.source for r in records if r.source != "cached"), "cached")
    return Decision(
        dtype=dtype,
        fp32_ms=round(sum(a for a, _ in per_token), 4),  # ms per token, summed over the batches
        bf16_ms=round(sum(b for _, b in per_token), 4),
        noise=max(r.noise for r in records),
        shape=shapes[0].key.rsplit("-b", 1)[0] + "-b" + "+".join(str(s.batch) for s in shapes),
        machine=machine_key(),
        source=source,
        step="decode",
    )


def inference_dtype(name: str, device_type: str, model_cfg, batches: tuple[int, ...]) -> tuple[str, Decision | None]:
    """generate's and serve's weight dtype for a dtype setting: "auto" on the CPU as measured
    (`cpu_decode_dtype` at the batch sizes the command runs), else as `devices.dtype_name`."""
    if name == "auto" and device_type == "cpu":
        decision = cpu_decode_dtype(model_cfg, batches)
        return decision.dtype, decision
    return dtype_name(name, device_type=device_type), None


def autocast_dtype(name: str, device_type: str, model_cfg, rows: int) -> tuple[str, Decision | None]:
    """Training's autocast dtype for a dtype setting: "auto" is bf16 on CUDA, measured on the CPU
    (`cpu_autocast`), fp32 elsewhere; anything else as `devices.dtype_name`. The Decision when measured."""
    if name == "auto" and device_type == "cpu":
        decision = cpu_autocast(model_cfg, rows)
        return decision.dtype, decision
    return dtype_name(name, device_type=device_type), None
