"""The `qkvlab` command: parses options and calls the library.

Each subcommand lives in ``qkvlab/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; its options are generated from config dataclasses by qkvlab.base.settings (no
option is declared by hand here or there but --help and --version). User errors print one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from qkvlab import __version__
from qkvlab.base.errors import UserError, as_user_error

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


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit status 2, and takes only whole option names
    (its default would read `compare --seed 5` as `--seeds 5`: five seeds, not seed 5)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; only `command`'s module is imported (the others cost start-up time)."""
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
    except Exception as e:  # a full disk or an unwritable folder is the machine's, not a bug: one line
        err = as_user_error(e)
        if err is None:
            raise
        print(f"qkvlab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
