"""Score a finished run's final weights on its task's test split again (`OUT/test.json`), for runs
whose test.json predates a scoring change (per-unit scores) or is missing. The same call as the
end of training (`loop.score_test`): the task and model are rebuilt from the run's own config."""

from __future__ import annotations

from pathlib import Path

import torch

from qkvlab.base.errors import UserError
from qkvlab.base.files import atomic_write, json_text
from qkvlab.model.folder import load_weights, read_config, tied_aliases
from qkvlab.tasks import task_from_config
from qkvlab.train.config import TrainConfig
from qkvlab.train.loop import TEST_SCORES


def rescore(run_dir: str | Path, batch_size: int | None = None) -> dict | None:
    """Rewrite run_dir/test.json from its model.safetensors; None when the task has no test split."""
    run_dir = Path(run_dir)
    _, body = read_config(run_dir)
    train = body.get("train") or {}
    if not train.get("finished"):
        raise UserError(f"{run_dir}: not a finished run (config.json's train.finished)")
    cfg = TrainConfig.from_dict(train["config"])
    task = task_from_config(cfg)
    torch.manual_seed(cfg.seed)
    model = task.build_model(task.adapt_config(cfg.model))
    state = load_weights(run_dir / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(tied_aliases(model))
    if unexpected or set(missing) - tied:
        raise UserError(f"{run_dir}: weights do not fit the run's model ({(unexpected or missing)[0]!r})")
    model.eval()
    with torch.no_grad():
        scored = task.test(model, batch_size=batch_size or cfg.val_batch_size)
    if scored is None:
        return None
    scored = {**scored, "step": cfg.max_steps, "dtype": "float32", "rescored": True}
    atomic_write(run_dir / TEST_SCORES, json_text(scored, indent=2))
    return scored
