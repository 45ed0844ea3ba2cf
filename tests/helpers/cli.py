"""Running a `vlmpack` command line inside the test process."""

from __future__ import annotations

from shards_schema.cli import main


def vlmpack_exit_code(argv: list[str]) -> int:
    """The exit code of `vlmpack ARGV`: what the dispatcher returns, or what argparse's own
    errors leave with (SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
