"""Settings declared once, on the config dataclasses; the command line, config files and validation
are generated from them.

A field made with `setting(...)` carries its help text, allowed values (`choices`), bounds
(`minimum`, `maximum`, `positive`), its flag (`flag`, default from the name) and other spellings
(`flags`), whether it is a positional argument, and whether it may change when a run resumes
(`resumable`). A field without a default is required. A `dict` field with `group=SomeConfig`
gathers that class's options (e.g. the model options) into a mapping.

- `add_options(parser, cls)`: one argparse option per field; every default is None, so only what the
  user typed overrides a config file or preset.
- `resolve(cls, *layers)`: the one way settings become a config: layers (a preset, a file's
  mapping, the command line's, a whole config) over each other, nested configs (a training
  config's model) resolved the same way, unknown keys refused, then the class's `validate()`
  (`check`, then the rules across fields). `load(cls, file, args)` is its file + command line.
- `check(obj)`: types, choices and bounds of every field, from its annotation and metadata.

What an annotation allows (`field_types`) and the parsers of a flag's text (`flag_values`) live
beside this module in qkvlab.base; this one declares, generates options, resolves and checks.

A short generator over `dataclasses.fields` rather than tyro or jsonargparse: the configs are flat
(plus nested model options, exposed as their own option group), the flag names must stay what the
docs and saved scripts use (`--no-mlp-skip`, `--tensorboard`, `--steps`), errors must be qkvlab's
one-line exit-2 kind, and no dependency is added. Torch-free: the bottom floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qkvlab.base.config_file import config_to_text, read_config_file
from qkvlab.base.errors import UserError
from qkvlab.base.field_types import base_type, bound_problem, item_type, type_hints, type_problem
from qkvlab.base.flag_values import nonempty, parse_key_values, parser_for

MISSING = dataclasses.MISSING


def setting(
    default: Any = MISSING,
    *,
    help: str,
    choices: Iterable[str] | None = None,
    resumable: bool = False,
    flag: str | None = None,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    cli: bool = True,
    default_factory: Any = MISSING,
    positional: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    const: Any = None,
    group: type | None = None,
    follows: str | None = None,
) -> Any:
    """A dataclass field with its command-line description (see the module doc). No default: the
    value is required. `positional`: an argument without a flag; `const`: the value of the bare
    flag (`--compile` = `--compile default`); bounds apply to numbers and to each item of a tuple; `follows`: the name of the field these values
    belong to (task options follow the task: `resolve` drops a base's when the task changes)."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "resumable": resumable,
        "flag": flag,
        "flags": flags,
        "metavar": metavar,
        "cli": cli,
        "positional": positional,
        "required": default is MISSING and default_factory is MISSING,
        "minimum": minimum,
        "maximum": maximum,
        "positive": positive,
        "const": const,
        "group": group,
        "follows": follows,
    }
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if meta["required"]:
        default = None  # argparse requires it; from Python, `check` does
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


# ---- seeds ----------------------------------------------------------------------------------
SEED_MAX = 2**63 - 1  # a signed 64-bit integer: what torch's generators and C-side seed arithmetic all take


def seed_setting(default: Any = 0, *, help: str) -> Any:
    """A seed: a whole number in [0, SEED_MAX] (a larger one made torch raise an overflow)."""
    return setting(default, help=help, minimum=0, maximum=SEED_MAX)


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
    decides them). A field with `group=` adds that class's options under its own title."""
    only = set(only) if only is not None else None
    exclude = set(exclude)
    target = parser.add_argument_group(title) if title else parser
    shown = {**defaults(cls), **(show_defaults or {})}
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("cli", False) or f.name in exclude or (only is not None and f.name not in only):
            continue
        if m["group"] is not None:
            add_options(parser, m["group"], title=m["help"], defaults_in_help=False)
            continue
        _add_one(target, f, type_hints(cls)[f.name], shown.get(f.name), defaults_in_help)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(_show, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _add_one(group, f: dataclasses.Field, hint: Any, shown: Any, defaults_in_help: bool) -> None:
    m = f.metadata
    help_text = m["help"]
    if defaults_in_help and shown not in (None, False) and not isinstance(shown, (dict, list)):
        if "default" not in help_text:
            help_text += f" (default {_show(shown)})"
    kind, _ = base_type(hint)
    names = (m["flag"] or "--" + f.name.replace("_", "-"), *m["flags"])
    if kind is bool:
        group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        return
    parse = parser_for(hint, m)
    if parse is None:
        return
    metavar = m["metavar"] or (None if m["choices"] else _METAVARS.get(kind, "VALUE"))
    if m["positional"]:
        nargs = None if m["required"] else "?"
        group.add_argument(f.name, nargs=nargs, type=parse, metavar=metavar, help=help_text)
        return
    repeat = item_type(kind) is str or kind is dict or typing.get_origin(kind) is dict
    extra: dict[str, Any] = {"action": "append"} if repeat else {"required": True} if m["required"] else {}
    if m["const"] is not None:
        extra = {"nargs": "?", "const": m["const"]}
    group.add_argument(
        *names, dest=f.name, type=parse, default=None, choices=m["choices"], metavar=metavar, help=help_text, **extra
    )


def options_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` the user set on the command line (a group field: the mapping of its
    class's options the user set; repeated TEXT: a tuple; repeated KEY=VALUE: a mapping)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("group") is not None:
            inner = options_from_args(args, f.metadata["group"])
            if inner:
                out[f.name] = inner
            continue
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if isinstance(value, list):
            kind, _ = base_type(type_hints(cls)[f.name])
            value = parse_key_values(value) if kind is dict or typing.get_origin(kind) is dict else tuple(value)
        out[f.name] = value
    return out


# ---- config file + command line ------------------------------------------------------------
def add_config_options(p: argparse.ArgumentParser, what: str = "settings") -> None:
    """--config FILE and --print-config, for every command that runs something."""
    p.add_argument("--config", metavar="FILE", type=nonempty, help=f"{what} file (.yaml/.yml/.toml/.json)")
    p.add_argument(
        "--print-config",
        nargs="?",
        const="yaml",
        choices=("yaml", "json"),
        help="print the resolved settings (YAML, or JSON) and exit",
    )


def print_config(args: argparse.Namespace, body: Mapping[str, Any]) -> bool:
    """Print `body` if --print-config was given; True when the command should stop there."""
    fmt = getattr(args, "print_config", None)
    if fmt is None:
        return False
    print(config_to_text(body, fmt))
    return True


def load(cls: type, file: str | Path | None = None, args: argparse.Namespace | None = None, **fixed: Any):
    """`cls` from a config file, the command line over it and `fixed` over both (`resolve`'s layers)."""
    body = read_config_file(file) if file else None
    over = options_from_args(args, cls) if args is not None else None
    return resolve(cls, body, over, fixed, origin=file)


def resolve(cls: type, *layers: Any, origin: str | Path | None = None) -> Any:
    """The one way settings become a config: a validated `cls` from `layers`, lowest first.

    A layer is None (skipped), a `cls` (a whole config), or a mapping of field names; a mapping's
    `preset` names one of `cls.presets`. The base is the highest whole config or named preset (else
    the declared defaults), and every mapping applies over it in order: preset -> file -> command
    line, whichever layer named the preset. Fields typed as a settings dataclass (a TrainConfig's
    `model`) are resolved the same way from their own layers; mappings (task options) merge key by
    key; a field declared `follows=NAME` keeps the base's value only while NAME keeps the base's (a
    preset's lm options never reach another task). An unknown key or a bad value is one line naming
    it (`origin`, a file, heads an unknown key's)."""
    layers = tuple(layer for layer in layers if layer is not None)
    for layer in layers:
        if not isinstance(layer, (cls, Mapping)):
            raise UserError(f"{_what(cls)} settings must be a mapping of keys, got {type(layer).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    presets = getattr(cls, "presets", None) or {}
    bases = [x for x in layers if isinstance(x, cls) or (presets and x.get("preset") is not None)]
    base = _base_values(cls, bases[-1], presets) if bases else {}
    body: dict[str, Any] = dict(base)
    nested: dict[str, list[Any]] = {k: [base[k]] for k in base if _nested_class(cls, k)}
    allowed = sorted([*names, *(["preset"] if presets else [])])
    for layer in layers:
        if isinstance(layer, cls):
            continue
        unknown = sorted(set(layer) - set(allowed))
        if unknown:
            where = f"{origin}: " if origin else ""
            raise UserError(f"{where}unknown {_what(cls)} {unknown[0]!r}; allowed: {', '.join(allowed)}")
        for k, v in layer.items():
            if k == "preset" and presets:
                continue
            if _nested_class(cls, k):
                nested.setdefault(k, []).append(v)
            elif isinstance(v, Mapping) and isinstance(body.get(k), Mapping):
                body[k] = {**body[k], **v}
            else:
                body[k] = dict(v) if isinstance(v, Mapping) else v
    for k, f in names.items():
        leader = names.get(f.metadata.get("follows") or "")
        if leader is not None and k in base and _value(base, leader) != _value(body, leader):
            # the base's values were for its own `leader` (a preset's lm options): only the layers' stay
            body[k] = {}
            for layer in layers:
                if isinstance(layer, Mapping) and isinstance(layer.get(k), Mapping):
                    body[k].update(layer[k])
    for k, sub in nested.items():
        body[k] = resolve(_nested_class(cls, k), *sub)
    try:
        obj = cls(**_coerce(cls, body))
    except TypeError as e:
        raise UserError(f"bad {cls.__name__} settings: {e}") from None
    return obj.validate() if hasattr(obj, "validate") else check(obj)


def _what(cls: type) -> str:
    """What a class's keys are called in messages: 'model setting', 'synthetic option'."""
    name = cls.__name__
    if name.endswith("Options"):
        return name.removesuffix("Options").lower() + " option"
    return name.removesuffix("Config").lower() + " setting"


def _value(values: Mapping[str, Any], field: dataclasses.Field) -> Any:
    return values.get(field.name, field.default if field.default is not MISSING else None)


def _base_values(cls: type, base: Any, presets: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The field values a base starts from (a whole config's, or a named preset's); mappings copied,
    so a config never shares one with a preset or another config."""
    if isinstance(base, cls):
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
    elif base["preset"] in presets:
        values = dict(presets[base["preset"]])
    else:
        raise UserError(f"unknown preset {base['preset']!r}; allowed: {', '.join(presets)}")
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in values.items()}


def _nested_class(cls: type, name: str) -> type | None:
    """The settings dataclass a field holds (resolved from its own layers), or None."""
    hint = type_hints(cls).get(name)
    kind = base_type(hint)[0] if hint is not None else None
    return kind if dataclasses.is_dataclass(kind) else None


def _coerce(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    """Lists from a file become the tuples the fields declare."""
    hints = type_hints(cls)
    for k, v in body.items():
        if isinstance(v, list) and typing.get_origin(base_type(hints.get(k))[0]) is tuple:
            body[k] = tuple(v)
    return body


# ---- validation from the declarations ----------------------------------------------------------
def check(obj: Any) -> Any:
    """Every declared field of `obj` against its type, choices and bounds; a problem is a one-line
    UserError `name=value must be ...`. Returns `obj`."""
    for f in dataclasses.fields(obj):
        m = f.metadata
        if "help" not in m:
            continue
        value = getattr(obj, f.name)
        kind, optional = base_type(type_hints(type(obj))[f.name])
        if value is None:
            if m["required"]:
                raise UserError(f"{f.name} is required")
            if optional:
                continue
        problem = type_problem(value, kind)
        if problem is None and m["choices"] is not None and value not in m["choices"]:
            raise UserError(f"{f.name}={value!r} is not allowed; use one of {', '.join(map(str, m['choices']))}")
        if problem is None and isinstance(value, (int, float, tuple, list)) and not isinstance(value, bool):
            items = value if isinstance(value, (tuple, list)) else (value,)
            problem = next((p for v in items if (p := bound_problem(v, m))), None)
        if problem:
            raise UserError(f"{f.name}={value!r} {problem}")
    return obj
