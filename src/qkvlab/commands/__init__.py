"""One module per `qkvlab` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
