"""The ``moeray`` command line. Parses flags, resolves models, prints results; the work is elsewhere.

This module holds the Typer app and ``main``; the commands live by family, each module adding its own:
offline ones in cli_offline.py, serving ones in cli_serving.py, operations in cli_ops.py, and what they
share (the stderr console, ``user_errors``, help texts) in cli_common.py.

User errors (bad flags, configs, checkpoints, prompts) print one line ``error: ...`` and exit 2.
"""

from __future__ import annotations

import typer

from . import cli_offline, cli_ops, cli_serving

app = typer.Typer(
    name="moeray",
    help="Serve Mixture-of-Experts models with Multi-head Latent Attention (Kimi K2, DeepSeek-V3) on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# The order of registration is the order `moeray --help` lists the commands in.
cli_offline.register(app)
cli_serving.register(app)
cli_ops.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
