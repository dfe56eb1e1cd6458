"""Where training progress goes besides metrics.jsonl: a progress bar and TensorBoard, each optional."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


@dataclass
class Log:
    bar: Any = None  # tqdm
    tb: Any = None  # torch.utils.tensorboard.SummaryWriter
    log_every: int = 1
    max_steps: int = 0

    @classmethod
    def open(cls, *, step: int, max_steps: int, log_every: int, desc: str, bar: bool, tb_dir: Path | None) -> Log:
        """A bar from `step` of `max_steps` if `bar`; TensorBoard events in `tb_dir` if given."""
        writer = progress = None
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

            writer = SummaryWriter(str(tb_dir), purge_step=step or None)
        if bar:
            progress = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, desc=desc)
        return cls(progress, writer, log_every, max_steps)

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """After each optimizer step (`step` counts finished steps)."""
        if self.bar is None:
            return
        self.bar.update(1)
        if step % self.log_every == 0 or step == self.max_steps:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def row(self, row: dict[str, Any], scores: dict[str, float]) -> None:
        """After each evaluation: the metrics row and the task's scores."""
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])
        if self.bar is not None:
            self.bar.write(f"step {row['step']}: " + " ".join(f"{k} {v:.4g}" for k, v in scores.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
