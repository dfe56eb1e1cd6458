"""A flag's value read from the text a user typed: finite numbers, whole numbers, comma-separated
lists, a number or a word, KEY=VALUE pairs. A bad value is one line naming it: argparse turns an
ArgumentTypeError into exit 2, and `parse_key_values` raises a UserError. qkvlab.base.settings picks
the parser for each field from its annotation. Torch-free: the bottom floor."""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from qkvlab.base.errors import UserError
from qkvlab.base.field_types import base_type, bound_problem, is_int_or_word, item_type


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a value")
    return text


def float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(finite_float(x) for x in nonempty(text).split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated finite numbers") from None


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in nonempty(text).split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each value must be a positive integer")
    return values


def int_or_word(text: str) -> int | str:
    """A whole number, or a word (e.g. --seeds auto); the field's validate() names the words."""
    try:
        return integer(text)
    except argparse.ArgumentTypeError:
        return nonempty(text)


def bounded(parse, m: Mapping[str, Any]):
    """`parse` followed by the field's bounds (each item of a tuple)."""

    def parse_bounded(text: str):
        value = parse(text)
        for v in value if isinstance(value, tuple) else (value,):
            problem = bound_problem(v, m) if isinstance(v, (int, float)) else None
            if problem:
                raise argparse.ArgumentTypeError(f"{v} {problem}")
        return value

    return parse_bounded


def parser_for(hint: Any, m: Mapping[str, Any]):
    """The parser of a field's flag from its annotation and metadata (None: a nested config, no flag)."""
    kind, _ = base_type(hint)
    if is_int_or_word(kind):
        return bounded(int_or_word, m)
    if kind is int:
        return bounded(integer, m)
    if kind is float:
        return bounded(finite_float, m)
    if kind is str:
        return nonempty
    item = item_type(kind)
    if item is str or typing.get_origin(kind) is dict or kind is dict:
        return nonempty  # repeatable: TEXT for tuples of text, KEY=VALUE for mappings
    if item is float:
        return bounded(float_list, m)
    if item is int:
        return bounded(int_list, m)
    return None  # nested configs: not a flag


def parse_key_values(items: Iterable[str], flag: str = "--task-option") -> dict[str, Any]:
    """KEY=VALUE strings -> mapping; VALUE read as YAML (numbers, true/false, null, [lists]), a
    number YAML leaves as text (1e-3) becomes a float, and none (Python's spelling) is null."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"{flag} {item!r} must be KEY=VALUE, e.g. length=64")
        try:
            value = yaml.safe_load(text.strip()) if text.strip() else ""
        except yaml.YAMLError:
            value = text.strip()
        if isinstance(value, str) and value.lower() == "none":
            value = None
        elif isinstance(value, str):
            try:
                value = float(value) if math.isfinite(float(value)) else value
            except ValueError:
                pass
        out[key.strip()] = value
    return out
