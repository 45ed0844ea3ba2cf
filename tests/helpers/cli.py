"""Running `vlmpack`: a command line inside the test process, or a child Python process on this
checkout."""

from __future__ import annotations

import os
from pathlib import Path

from shards_schema.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def vlmpack_exit_code(argv: list[str]) -> int:
    """The exit code of `vlmpack ARGV`: what the dispatcher returns, or what argparse's own
    errors leave with (SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def process_env() -> dict:
    """The environment of a child Python process that imports this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
