"""What the ``moeray`` command families share: the stderr console, ``user_errors`` (a ValueError
becomes one ``error: ...`` line and exit code 2), the model argument's resolution, and help texts
several commands repeat.

It imports no command module, so that ``deploy/cli.py`` can import every family even when it runs
as ``python -m deploy.cli`` (as ``moeray up --detach`` starts it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

err = Console(stderr=True)


def user_errors(fn):
    """Turn ValueError (our user-input errors) into one clear line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            err.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


MODEL_HELP = ("A Hugging Face checkpoint directory or a preset name (kimi-k2-tiny, kimi-k2-thinking-tiny, "
              "deepseek-v3-tiny, kimi-linear-tiny, kimi-k3-tiny, kimi-k2-small; kimi-k2-mini, trained).")
URL_HELP = "Base URL of the app (default: the one `moeray up` started)."
KEY_HELP = "API key, if the server needs one."
ADMIN_KEY_HELP = ("The server's admin key (default: for the app `moeray up` started, the token it wrote; else "
                  "$MOERAY_ADMIN_KEY).")


def parse_json_option(text: str | None, flag: str,
                      example: str = '{"method": "suffix", "num_speculative_tokens": 4}') -> dict | None:
    """A flag whose value is a JSON object (``--speculative-config``); ValueError naming the flag."""
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON ({e.msg} at character {e.pos}); give an object such as "
                         f"'{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: give a JSON object, got {text!r}")
    return value


def resolve_model(model: str) -> Path:
    """The checkpoint directory of ``model``: a directory as given, or a preset built in the cache."""
    from model.presets import resolve_model as resolve

    from .settings import cache_root

    return resolve(model, cache_root())
