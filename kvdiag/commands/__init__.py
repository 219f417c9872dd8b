"""One module per CLI subcommand, each with `add_arguments(parser)` and `run(args) -> int`."""
