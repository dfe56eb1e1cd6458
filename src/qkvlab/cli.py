"""The `qkvlab` command: parses options and calls the library.

Each subcommand lives in ``qkvlab/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``. User errors print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from qkvlab.config import PRESETS, ModelConfig, preset
from qkvlab.errors import UserError
from qkvlab.settings import add_options, config_to_text, nonempty, options_from_args, positive_int

COMMANDS = {
    "info": "parameters, KV-cache bytes and FLOPs of a model config",
    "init": "write a randomly initialised model folder",
    "prepare": "tokenize a corpus once (streaming, resumable) before training",
    "train": "train a model on a corpus or task",
    "compare": "train every attention scheme and tabulate the results",
    "convert": "exact weight conversion between schemes (Paper A's theorems); HF import/export",
    "retrofit": "turn a trained model into K=V / GQA / MQA: fit on real text, then uptrain by distillation",
    "similarity": "Q/K/V similarity: activation CKA on text, weight cosine, effective rank",
    "generate": "generate text from a trained model with a KV cache",
    "bench": "throughput, cache bytes and capacity per scheme",
    "serve": "an OpenAI-compatible HTTP endpoint with continuous batching on the spec-sized KV cache",
}

DEFAULT_PRESET = "small"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit status 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


_positive_int = positive_int  # commands' integer options share the settings' parsers


def add_model_options(p: argparse.ArgumentParser, *, with_preset_default: bool = True) -> None:
    """--preset plus one option per ModelConfig field (generated from its metadata)."""
    g = p.add_argument_group("model options")
    g.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help=f"start from a model preset (default: {DEFAULT_PRESET})" if with_preset_default else "start from a preset",
    )
    add_options(g, ModelConfig, defaults_in_help=False)  # the preset decides the defaults


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


def print_config(args: argparse.Namespace, body: dict) -> bool:
    """Print `body` if --print-config was given; True when the command should stop there."""
    fmt = getattr(args, "print_config", None)
    if fmt is None:
        return False
    print(config_to_text(body, fmt))
    return True


def model_overrides(args: argparse.Namespace) -> dict:
    return options_from_args(args, ModelConfig)


def model_config_file(path: str) -> ModelConfig:
    """A model config file: ModelConfig keys (optionally a `preset`), or a mapping with a `model`
    section (a training config or a saved config.json)."""
    from qkvlab.train.config import model_from_mapping, read_config_file

    body = read_config_file(path)
    return model_from_mapping(body.get("model", body) if isinstance(body.get("model"), dict) else body)


def model_config_from_args(args: argparse.Namespace, base: ModelConfig | None = None) -> ModelConfig:
    """Preset (or `base`, or --config FILE) with the command-line overrides applied, validated."""
    if base is None and getattr(args, "config", None):
        base = model_config_file(args.config)
    overrides = model_overrides(args)
    if base is not None and args.preset is None:
        return ModelConfig.from_dict({**base.to_dict(), **overrides})
    return preset(args.preset or DEFAULT_PRESET, **overrides)


def find_model_dir(path: str) -> Path:  # shared by generate and info
    """The folder itself, or its `checkpoint/` while a training run has not written its final model."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such model folder")
    if p.is_dir() and not (p / "config.json").exists() and (p / "checkpoint" / "config.json").exists():
        return p / "checkpoint"
    if not p.is_dir():
        raise UserError(
            f"{path}: a file, not a model folder (expected a folder with config.json and "
            "model.safetensors, written by qkvlab init/train/convert)"
        )
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; only `command`'s module is imported (the others cost start-up time)."""
    from qkvlab import __version__

    parser = OneLineParser(prog="qkvlab", description="Transformers with fewer attention projections.")
    parser.add_argument("--version", action="version", version=f"qkvlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, help_text in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(f"qkvlab.commands.{name}")
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad option (one line already printed)
        return e.code if isinstance(e.code, int) else 0
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as e:
        print(f"qkvlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `qkvlab compare --dry-run | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"qkvlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
