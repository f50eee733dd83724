"""`moeray` in this process (tests): the Typer app with its error handling, without a Python start-up
per run. Importable from every test module the shared conftest loads (tests/ is on the path)."""

from types import SimpleNamespace


def in_process(*args) -> SimpleNamespace:
    """`moeray ARGS` through the same Typer app and error handling, in this process: exit code,
    stdout and stderr as a subprocess would give them."""
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # an uncaught exception: a subprocess would print a traceback
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)
