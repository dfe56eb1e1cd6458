"""Set anomaly detection (Paper B): sets of 10 items, 9 from one class and 1 from another;
the target is the slot of the odd one.

The odd slot is drawn uniformly for every set: with a fixed slot, any positional signal
would leak the answer. Majority and odd classes are drawn uniformly over classes; the
majority members of one set are distinct items.
"""

from __future__ import annotations

import torch

from qkvlab.base.errors import UserError

ODD_SLOTS = ("random", "last")


def anomaly_set_indices(
    labels: torch.Tensor, n: int, seed: int, set_size: int = 10, odd_slot: str = "random"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index (n, set_size) into the source items, target (n,) odd slot), int64.
    Indices let callers gather lazily instead of copying ten images per set. odd_slot "random":
    uniform per set (the default); "last": always the last slot, as the reference code does (a
    positional term can then find it without looking at the items: the ablation's control)."""
    if odd_slot not in ODD_SLOTS:
        raise UserError(f"odd_slot={odd_slot!r} is not allowed; use {' or '.join(ODD_SLOTS)}")
    y = torch.as_tensor(labels).long().reshape(-1)
    if int(n) < 1 or int(set_size) < 3:
        raise UserError(f"anomaly sets need n >= 1 and set_size >= 3, got n={n}, set_size={set_size}")
    if int(seed) < 0:
        raise UserError(f"seed must be >= 0, got {seed}")
    classes, counts = y.unique(return_counts=True)
    majority_ok = (counts >= set_size - 1).nonzero().flatten()
    if len(classes) < 2 or len(majority_ok) == 0:
        raise UserError(
            f"anomaly sets need >= 2 classes and one with >= {set_size - 1} items; "
            f"got {len(classes)} classes, largest {int(counts.max()) if len(counts) else 0}"
        )
    g = torch.Generator().manual_seed(int(seed))
    order = torch.argsort(y, stable=True)  # items grouped by class (classes sorted)
    starts = torch.cumsum(counts, 0) - counts
    k = set_size - 1

    major = majority_ok[torch.randint(len(majority_ok), (n,), generator=g)]  # class positions
    r = torch.randint(len(classes) - 1, (n,), generator=g)
    odd = r + (r >= major).long()  # uniform over the other classes
    slot = torch.randint(set_size, (n,), generator=g)  # drawn either way: the items stay the same
    if odd_slot == "last":
        slot = torch.full_like(slot, set_size - 1)

    members = torch.empty(n, k, dtype=torch.long)
    for c in major.unique().tolist():  # k distinct items of class c per set: top-k of noise
        rows = (major == c).nonzero().flatten()
        cnt = int(counts[c])
        step = max(1, 4_000_000 // cnt)  # bound the noise matrix to ~16 MB
        for i in range(0, len(rows), step):
            part = rows[i : i + step]
            pick = torch.rand(len(part), cnt, generator=g).topk(k, dim=1).indices
            members[part] = order[starts[c] + pick]
    odd_item = order[starts[odd] + (torch.rand(n, generator=g) * counts[odd]).long().clamp_max(counts[odd] - 1)]

    pos = torch.arange(set_size).expand(n, set_size)
    before = pos < slot[:, None]
    src = torch.where(before, pos, pos - 1).clamp(0, k - 1)
    index = torch.where(pos == slot[:, None], odd_item[:, None], members.gather(1, src))
    return index, slot


def make_anomaly_sets(
    x: torch.Tensor, labels: torch.Tensor, n: int, seed: int, set_size: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sets (n, set_size, *x.shape[1:]), target (n,)) from images or feature vectors ``x``
    (e.g. ``ImageDataset.x``/``.y``)."""
    if x.shape[0] != torch.as_tensor(labels).numel():
        raise UserError(f"anomaly sets: {x.shape[0]} items but {torch.as_tensor(labels).numel()} labels")
    index, target = anomaly_set_indices(labels, n, seed, set_size)
    return x[index], target
