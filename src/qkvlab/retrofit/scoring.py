"""How a retrofit is scored: perplexity over consecutive windows of held-out text, and the ratio of two models'
perplexities with its interval over those windows.

Both models read the same windows, so the ratio is exp(mean_w (NLL_new(w) - NLL_old(w))) and its 95% interval
is the t-interval of the per-window differences, exponentiated. What a perplexity means depends on its windows:
a model's perplexity over the first 512 held-out tokens and over 8,192 can differ by a third (SmolLM2-135M: 46.97
and 42.98 on Shakespeare), because texts differ in difficulty along their length; a ratio of two models on the
same windows moves far less, and its interval says by how much it can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy import stats
from tqdm.auto import tqdm

from qkvlab.base.errors import UserError
from qkvlab.model.transformer import GPT


@torch.no_grad()
def window_nll(
    model: GPT, tokens: torch.Tensor, *, block: int, max_tokens: int, batch: int = 4, progress: str | None = None
) -> torch.Tensor:
    """Mean next-token NLL of every consecutive non-overlapping window of `block` tokens in the first
    `max_tokens` (n,), float64. progress: a label to show a bar with its rate and ETA under."""
    n = min(len(tokens) - 1, max_tokens) // block
    if n == 0:
        raise UserError(f"held-out text has {len(tokens)} tokens, fewer than one window of {block}")
    p = next(model.parameters())
    model.eval()
    out = []
    for lo in tqdm(range(0, n, batch), desc=progress, unit="batch", disable=progress is None, leave=False):
        rows = range(lo, min(n, lo + batch))
        x = torch.stack([tokens[i * block : (i + 1) * block] for i in rows]).to(p.device)
        y = torch.stack([tokens[i * block + 1 : (i + 1) * block + 1] for i in rows]).to(p.device)
        logits, _ = model(x)
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none").mean(1)  # (rows,)
        out.append(nll.double().cpu())
    return torch.cat(out)


def perplexity(model: GPT, tokens: torch.Tensor, *, block: int, max_tokens: int, batch: int = 4) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows of `block` tokens."""
    return math.exp(float(window_nll(model, tokens, block=block, max_tokens=max_tokens, batch=batch).mean()))


@dataclass(frozen=True)
class Ratio:
    """ppl_new / ppl_old on the same windows, with its 95% interval over them."""

    estimate: float
    lo: float
    hi: float
    windows: int

    def text(self) -> str:
        return f"x{self.estimate:.3f} [{self.lo:.3f}, {self.hi:.3f}] over {self.windows} windows"


def ratio_interval(new: torch.Tensor, old: torch.Tensor) -> Ratio:
    """The perplexity ratio of two models' per-window NLLs (window_nll, the same windows)."""
    d = (new - old).double()
    mean = float(d.mean())
    if len(d) < 2:
        return Ratio(math.exp(mean), math.nan, math.nan, len(d))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * float(d.std(unbiased=True)) / math.sqrt(len(d))
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(d))
