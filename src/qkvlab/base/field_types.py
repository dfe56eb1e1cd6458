"""What a setting's annotation allows: the type without None, the item type of a tuple, and what is
wrong (if anything) with a value for that type or for the field's bounds. qkvlab.base.settings
builds its options and its checks from these. Torch-free: the bottom floor."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from typing import Any


def base_type(hint: Any) -> tuple[Any, bool]:
    """(type without None, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return hint, False


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """A class's field annotations, resolved (cached: the classes never change)."""
    return typing.get_type_hints(cls)


def item_type(kind: Any) -> Any:
    """The item type of a tuple annotation, else None."""
    return typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None


def is_int_or_word(kind: Any) -> bool:
    """`int | str`: a whole number, or a word the field's validate() names (--seeds auto)."""
    return set(typing.get_args(kind)) == {int, str}


def bound_problem(value: Any, m: Mapping[str, Any]) -> str | None:
    """What is wrong with a number against the field's bounds (None: nothing)."""
    whole = isinstance(value, int)
    if m.get("positive") and not value > 0:
        return "must be positive"
    lo, hi = m.get("minimum"), m.get("maximum")
    if lo is not None and value < lo:
        return "must be a positive integer" if whole and lo == 1 else f"must be >= {lo}"
    if hi is not None and value > hi:
        return f"must be <= {hi}"
    return None


def type_problem(value: Any, kind: Any) -> str | None:
    """What is wrong with `value` for the type `kind` (None: nothing)."""
    if kind is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "must be a finite number"
    if kind is str:
        if not isinstance(value, str):
            return "must be text"
        return None if value.strip() else "is empty; give a value"
    if kind is dict or typing.get_origin(kind) is dict:
        return None if isinstance(value, Mapping) else "must be a mapping"
    if typing.get_origin(kind) is tuple:
        items = typing.get_args(kind)
        if not isinstance(value, (tuple, list)):
            return "must be a list"
        if items[-1] is not Ellipsis and len(value) != len(items):
            return f"must be a list of {len(items)} values"
        return next((type_problem(v, items[0]) for v in value if type_problem(v, items[0])), None)
    if is_int_or_word(kind):
        ok = isinstance(value, str) or type_problem(value, int) is None
        return None if ok else "must be an integer or a word"
    if dataclasses.is_dataclass(kind):
        return None if isinstance(value, kind) else f"must be a {kind.__name__}"
    return None
