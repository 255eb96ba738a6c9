"""One module per ``remat`` subcommand; each exposes ``register(subparsers)`` and ``run(args, extra) -> int``."""
