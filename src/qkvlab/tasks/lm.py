"""Language modelling: next-token cross-entropy on a prepared corpus (Shakespeare by default).

Options: `data` (None = the Shakespeare plays shipped with qkvlab; a path; "hf:NAME?split=..."), `tokenizer`
("bpe:N", "char", "gpt2"; default "bpe:2048"), `block_size` (default: the model's context).
Tokenizing happens once (`qkvlab.data.prepare` caches it); batches are random windows drawn from
a generator seeded by (seed, step), so any step's batch can be rebuilt without loader state.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from qkvlab.base.devices import torchrun_env
from qkvlab.base.errors import UserError
from qkvlab.base.settings import setting
from qkvlab.data.prepare import PreparedData, fixed_val_batches, get_batch, prepare
from qkvlab.data.tokenizer import DEFAULT_TOKENIZER
from qkvlab.model.config import ModelConfig
from qkvlab.model.transformer import GPT
from qkvlab.tasks.base import Task

VAL_SEED = 1234  # the same validation windows for every run, whatever its training seed
VOCAB_MULTIPLE = 64  # pad the embedding like nanoGPT (50257 -> 50304): faster matmuls, unused rows


@dataclass
class LMOptions:
    data: str | None = setting(
        None,
        help="corpus: a path, 'shakespeare[:genres]', 'hf:NAME?split=..', or several joined by '+' "
        "(default: the Shakespeare plays shipped with qkvlab)",
    )
    tokenizer: str = setting(DEFAULT_TOKENIZER, help="bpe:N, char or gpt2")
    block_size: int | None = setting(None, help="training window (default: the model context)", minimum=1)
    val_fraction: float = setting(0.1, help="the held-out tail of every document (validation, then test)")


OPTIONS_CLASS = LMOptions  # the class `qkvlab.tasks.resolve_task_options` builds


def step_generator(seed: int, step: int) -> torch.Generator:
    """A generator whose state depends only on (seed, step) (hashed, so streams never overlap)."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class LMTask(Task):
    name = "lm"
    metric = "val_loss"
    higher_is_better = False
    model_kind = "gpt"

    def __init__(
        self,
        data: Any = None,
        tokenizer: str = DEFAULT_TOKENIZER,
        block_size: int | None = None,
        val_fraction: float = 0.1,
    ):
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise UserError(f"block_size={block_size!r} must be a positive integer")
        self.source, self.tokenizer_spec, self._block_size = data, tokenizer, block_size
        # ranks of a multi-process run never tokenize: `qkvlab prepare` does it once, beforehand
        single = torchrun_env()[1] <= 1
        self.prepared: PreparedData = prepare(data, tokenizer, val_fraction=val_fraction, tokenize=single)
        self._val: dict[tuple[int, int, int], list] = {}
        self.cfg: ModelConfig | None = None  # set by adapt_config

    @property
    def vocab_size(self) -> int:
        return self.prepared.vocab_size

    def block_size(self, cfg: ModelConfig | None) -> int:
        if cfg is None:
            raise RuntimeError("call adapt_config(model_config) before drawing batches")
        return self._block_size or cfg.context

    def adapt_config(self, cfg: ModelConfig) -> ModelConfig:
        vocab = -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        cfg = cfg.replace(vocab_size=vocab)
        if self._block_size is not None and self._block_size > cfg.context and cfg.pos == "learned":
            raise UserError(f"block_size={self._block_size} exceeds the model context {cfg.context}")
        self.cfg = cfg.validate()
        return self.cfg

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        return GPT(cfg)

    @property
    def heldout(self) -> tuple[np.ndarray, np.ndarray]:
        """(validation, test): the first and second halves of the held-out tokens (the last
        val_fraction of every document, in corpus order). Validation draws the curves' fixed random
        windows; test is scored once, whole, for verdicts."""
        held = self.prepared.val
        return held[: len(held) // 2], held[len(held) // 2 :]

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.prepared.train, batch_size, self.block_size(self.cfg), step_generator(seed, step))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = model(inputs, targets)
        return loss

    shards_evaluation = True  # evaluate(shard=env): each rank takes its share of the fixed batches

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, *, batch_size: int, max_batches: int | None = None, shard=None
    ) -> dict[str, float]:
        """Mean loss over the fixed validation batches. shard (a train.distributed.Env): this rank
        evaluates batches rank, rank + world, ... and the sums are all-reduced; every rank runs the
        same number of forwards (FSDP's forward is a collective), padding ones counted zero."""
        n = max_batches or 10
        key = (n, batch_size, self.block_size(self.cfg))
        if key not in self._val:
            self._val[key] = fixed_val_batches(self.heldout[0], n, batch_size, key[2], seed=VAL_SEED)
        device = next(model.parameters()).device
        rank, world = (shard.rank, shard.world) if shard is not None else (0, 1)
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, batches)
        for i in range(rank, -(-n // world) * world, world):
            x, y = self._val[key][i % n]
            loss = self.loss(model, x.to(device), y.to(device)).double()
            if i < n:
                sums += torch.stack((loss, torch.ones_like(loss)))
        if shard is not None and shard.distributed:
            dist.all_reduce(sums)  # a sum over ranks (a task knows no more of distribution)
        val_loss = float(sums[0] / sums[1])
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}

    @torch.no_grad()
    def test(self, model: nn.Module, *, batch_size: int) -> dict[str, Any]:
        """Mean next-token loss over every non-overlapping window of the test half (see Task.test);
        the unit is a window of block_size tokens, se = SD of window losses / sqrt(windows)."""
        data, block = self.heldout[1], self.block_size(self.cfg)
        n = (len(data) - 1) // block
        if n < 2:
            raise UserError(f"the test split has {len(data)} tokens: fewer than two windows of {block}")
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        losses = []
        try:
            for first in range(0, n, batch_size):
                starts = np.arange(first, min(n, first + batch_size))[:, None] * block
                w = torch.from_numpy(np.asarray(data[starts + np.arange(block + 1)], dtype=np.int64)).to(device)
                logits, _ = model(w[:, :-1])  # (B, T, vocab)
                nll = F.cross_entropy(logits.float().transpose(1, 2), w[:, 1:], reduction="none")  # (B, T)
                losses.append(nll.mean(-1).double().cpu())
        finally:
            model.train(was_training)
        per_window = torch.cat(losses)
        loss = float(per_window.mean())
        return {
            "split": "test",
            "metric": "loss",
            "loss": loss,
            "ppl": math.exp(min(loss, 700.0)),
            "n": n,
            "units": f"window of {block} tokens",
            "tokens": n * block,
            "se": float(per_window.std() / n**0.5),
            "per_unit": [round(float(x), 6) for x in per_window],  # pairs runs window by window (analysis)
        }

    def save_artifacts(self, folder: Path) -> None:
        self.prepared.tokenizer().save(folder / "tokenizer")  # `qkvlab generate OUT` finds it there

    def describe(self) -> dict[str, Any]:
        m = self.prepared.meta
        return {
            "task": self.name,
            "data": m["source"],
            "tokenizer": m["tokenizer"],
            "vocab_size": m["vocab_size"],
            "tokens": m["tokens"],
            "corpus_sha256": m["corpus_sha256"],
            "block_size": self._block_size,
        }


def make_task(name: str = "lm", options: LMOptions | None = None) -> LMTask:
    return LMTask(**asdict(options or LMOptions()))
