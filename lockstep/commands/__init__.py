"""One module per `lockstep` subcommand: `add_arguments(parser)` and `run(args)`."""
