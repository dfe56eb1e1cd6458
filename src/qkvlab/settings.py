"""Settings declared once, on the config dataclasses; the command line is generated from them.

A field made with `setting(...)` carries its help text, allowed values (`choices`), extra flag
spellings (`flags`) and whether it may change when a run resumes (`resumable`). `add_options`
turns a dataclass's fields into argparse options and `options_from_args` reads them back as a
mapping of the fields the user set (None: not given, so the config file or preset decides).

A short generator over `dataclasses.fields` rather than tyro or jsonargparse: the configs are flat
(plus one nested ModelConfig, exposed as its own option group), the flag names must stay what the
docs and saved scripts use (`--no-mlp-skip`, `--tensorboard`, `--steps`), errors must be qkvlab's
one-line exit-2 kind, and no dependency is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any

MISSING = dataclasses.MISSING


def setting(
    default: Any = MISSING,
    *,
    help: str,
    choices: Iterable[str] | None = None,
    resumable: bool = False,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    cli: bool = True,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field with its command-line description (see the module doc)."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "resumable": resumable,
        "flags": flags,
        "metavar": metavar,
        "cli": cli,
    }
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def resumable_fields(cls: type) -> tuple[str, ...]:
    """Names of the fields that may differ between a run and its resume."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("resumable"))


def defaults(cls: type) -> dict[str, Any]:
    """Every field's default value (factories called)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


# ---- value parsers: one line naming the bad value, raised by argparse as exit 2 ---------------
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


SIZE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def byte_size(text: str, flag: str = "size") -> int:
    """A memory size as qkvlab spells it everywhere: 8MB, 24GB, 80GiB, 512MiB or plain bytes."""
    from qkvlab.errors import UserError

    t = str(text).strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value = float(num) * SIZE_UNITS[t[len(num) :]]
    except (ValueError, KeyError):
        raise UserError(f"{flag} {text!r}: write a size like 24GB, 80GiB or 512MB") from None
    if not value > 0 or value == float("inf"):
        raise UserError(f"{flag} {text!r} must be positive")
    return int(value)


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


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(type without None, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def int_or_word(text: str) -> int | str:
    """A whole number, or a word (e.g. --seeds auto); the field's choices name the words."""
    try:
        return integer(text)
    except argparse.ArgumentTypeError:
        return nonempty(text)


def _parser_for(hint: Any):
    kind, _ = _base_type(hint)
    origin = typing.get_origin(kind)
    if set(typing.get_args(kind)) - {type(None)} == {int, str}:
        return int_or_word
    if kind is bool:
        return None
    if kind is int:
        return integer
    if kind is float:
        return finite_float
    if kind is str:
        return nonempty
    if origin is tuple:
        inner = typing.get_args(kind)[0]
        return float_list if inner is float else int_list
    return None  # dicts and nested configs: not a flag


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_options(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    title: str | None = None,
    show_defaults: Mapping[str, Any] | None = None,
    defaults_in_help: bool = True,
) -> None:
    """One option per field of `cls` (in declaration order); every default is None so that only
    what the user typed overrides a config file or preset. `show_defaults` overrides the default
    printed in help (e.g. a command's own recipe); `defaults_in_help=False` prints none (a preset
    decides them)."""
    hints = typing.get_type_hints(cls)
    only = set(only) if only is not None else None
    exclude = set(exclude)
    group = parser.add_argument_group(title) if title else parser
    base = defaults(cls)
    shown = {**base, **(show_defaults or {})}
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("cli", False) or f.name in exclude or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        names = (flag, *m["flags"]) if flag not in m["flags"] else m["flags"]
        help_text = m["help"]
        d = shown.get(f.name)
        if defaults_in_help and d is not None and not isinstance(d, (dict, list)) and "default" not in help_text:
            help_text += f" (default {','.join(map(str, d)) if isinstance(d, tuple) else d})"
        kind, _ = _base_type(hints[f.name])
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        parse = _parser_for(hints[f.name])
        if parse is None:
            continue
        group.add_argument(
            *names,
            dest=f.name,
            type=parse,
            default=None,
            choices=m["choices"],
            metavar=m["metavar"] or (None if m["choices"] else _METAVARS.get(kind, "VALUE")),
            help=help_text,
        )


def options_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` the user set on the command line."""
    names = [f.name for f in dataclasses.fields(cls)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def config_to_text(body: Mapping[str, Any], fmt: str = "yaml") -> str:
    """A resolved config as YAML (default) or JSON, for --print-config."""
    import json

    if fmt == "json":
        return json.dumps(body, indent=2)
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(body)), sort_keys=False).rstrip()


def parse_key_values(items: Iterable[str], flag: str = "--task-option") -> dict[str, Any]:
    """KEY=VALUE strings -> mapping; VALUE read as YAML (numbers, true/false, null, [lists]), and a
    number YAML leaves as text (1e-3) becomes a float."""
    import yaml

    from qkvlab.errors import UserError

    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"{flag} {item!r} must be KEY=VALUE, e.g. length=64")
        try:
            value = yaml.safe_load(text.strip()) if text.strip() else ""
        except yaml.YAMLError:
            value = text.strip()
        if isinstance(value, str):
            try:
                value = float(value) if math.isfinite(float(value)) else value
            except ValueError:
                pass
        out[key.strip()] = value
    return out
