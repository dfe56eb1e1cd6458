"""The `qkvlab` command: parses options and calls the library.

Each subcommand lives in ``qkvlab/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``. User errors print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from qkvlab.config import MLPS, NORMS, POSITIONS, PRESETS, ModelConfig, preset
from qkvlab.errors import UserError

COMMANDS = {
    "info": "parameters, KV-cache bytes and FLOPs of a model config",
    "init": "write a randomly initialised model folder",
    "train": "train a model on a corpus or task",
    "compare": "train every attention scheme and tabulate the results",
    "convert": "exact weight conversion between schemes (Paper A's theorems); HF import/export",
    "similarity": "cosine similarity and effective rank of Q/K/V projections",
    "generate": "generate text from a trained model with a KV cache",
    "bench": "throughput, cache bytes and capacity per scheme",
}

DEFAULT_PRESET = "small"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit status 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def add_model_options(p: argparse.ArgumentParser, *, with_preset_default: bool = True) -> None:
    g = p.add_argument_group("model options")
    g.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help=f"start from a preset (default: {DEFAULT_PRESET})" if with_preset_default else "start from a preset",
    )
    g.add_argument("--attn", metavar="SCHEME", help="projection scheme, e.g. Q-K-V, Id-K-V, Q-K=V, '(Q=K-V)+'")
    g.add_argument("--kv-heads", type=_positive_int, metavar="N", help="key/value heads (n_head: MHA, g: GQA, 1: MQA)")
    g.add_argument("--n-layer", type=_positive_int, metavar="N")
    g.add_argument("--n-head", type=_positive_int, metavar="N")
    g.add_argument("--d-model", type=_positive_int, metavar="N")
    g.add_argument("--d-head", type=_positive_int, metavar="N")
    g.add_argument(
        "--mlp-hidden",
        type=_positive_int,
        metavar="N",
        help="MLP width (with --match-params: the reference model's width)",
    )
    g.add_argument(
        "--match-params", metavar="SCHEME", help="re-spend saved attention params on the MLP to match SCHEME"
    )
    g.add_argument("--mlp", choices=MLPS)
    g.add_argument("--norm", choices=NORMS)
    g.add_argument(
        "--no-mlp-skip", dest="mlp_skip", action="store_false", default=None, help="no residual skip around the MLP"
    )
    g.add_argument("--share-layers", action="store_true", default=None, help="one block's weights for every layer")
    g.add_argument("--pos", choices=POSITIONS)
    g.add_argument("--vocab-size", type=_positive_int, metavar="N")
    g.add_argument("--context", type=_positive_int, metavar="N")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--attn-scale", type=float, metavar="S", help="score scale (default 1/sqrt(d_head), 1/(2 sqrt(d_head)) with Id)"
    )
    g.add_argument("--dropout", type=float)


MODEL_OPTION_FIELDS = (
    "attn",
    "kv_heads",
    "n_layer",
    "n_head",
    "d_model",
    "d_head",
    "mlp_hidden",
    "match_params",
    "mlp",
    "norm",
    "mlp_skip",
    "share_layers",
    "pos",
    "vocab_size",
    "context",
    "bias",
    "attn_scale",
    "dropout",
)


def model_overrides(args: argparse.Namespace) -> dict:
    return {f: getattr(args, f) for f in MODEL_OPTION_FIELDS if getattr(args, f, None) is not None}


def model_config_from_args(args: argparse.Namespace, base: ModelConfig | None = None) -> ModelConfig:
    """Preset (or `base`) with the command-line overrides applied, validated."""
    overrides = model_overrides(args)
    if base is not None and args.preset is None:
        return ModelConfig.from_dict({**base.to_dict(), **overrides})
    return preset(args.preset or DEFAULT_PRESET, **overrides)


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
    args = parser.parse_args(argv)
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
