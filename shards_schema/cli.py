"""`vlmpack` command line: a dispatcher over subcommands owned by their packages.

Subcommands are named by module path and imported only when run, so `vlmpack train` never
loads the preprocessing stack (tokenizers, PIL) and this package imports neither side.
Each entry names an object with `add_arguments(parser)` and `run(args) -> int`.

Output piped into a reader that has gone (`vlmpack inspect DIR | head`) ends any command
quietly with exit status 141 (128 + SIGPIPE), what a shell reports for a tool killed by
SIGPIPE: no traceback, and the pipeline's own status tells a cut-short listing apart.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .errors import (EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError, print_error,
                     user_error_from_os_error, user_error_from_symlink_loop)

# name -> ("module:object", one-line help)
COMMANDS = {
    "quickstart": ("preprocess.cli:Quickstart", "preprocess a generated example dataset (no download) and show the result"),
    "preprocess": ("preprocess.cli:Preprocess", "chats + images (JSONL/JSON/Parquet/datasets) -> shards"),
    "merge": ("preprocess.cli:Merge", "join the outputs of a partitioned preprocessing job into one shard directory"),
    "inspect": ("shards_schema.inspect:Inspect", "what a shard directory holds: totals, rejects, distributions, charts"),
    "show": ("preprocess.show:Show", "one sample decoded back to text, targets highlighted, images rebuilt"),
    "verify": ("shards_schema.verify:Verify", "check a shard directory end to end (exit code != 0 on any fault)"),
    "pack": ("train.cli:Pack", "plan packs over shard directories (offline, sizes only)"),
    "train": ("train.cli:Train", "train on shard directories (launch with torchrun: one process per GPU)"),
    "import-hf": ("train.cli:ImportHF", "Hugging Face Qwen-VL checkpoint -> Megatron model directory (any TP/PP)"),
    "export-hf": ("train.cli:ExportHF", "Megatron model directory -> Hugging Face checkpoint"),
    "fetch": ("shards_schema.fetch:Fetch", "copy a shard directory from an object store (s3://, gs://, ...) to local "
                                           "disk, checked against its manifest"),
    "export": ("shards_schema.webdataset.command:Export", "shard directory -> WebDataset tar shards"),
    "import": ("shards_schema.webdataset.command:Import", "WebDataset tar shards -> shard directory"),
}


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line, like every other user error (the usage is one --help away)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a value such as `-1G` is a value, not an option (no option of ours starts with a
        # digit): so its flag names what is wrong with it. Python 3.13's own pattern
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _print_message(self, message: str, file=None) -> None:
        # argparse's own drops write errors: `--help | head` would then exit 0, other commands 141
        if message:
            (file or sys.stderr).write(message)


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: vlmpack <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`vlmpack <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(sys.argv[1:] if argv is None else argv)
        finally:
            sys.stdout.flush()  # here, not at interpreter exit: a closed pipe must fail inside this try
    except BrokenPipeError:
        # the reader of our output went away (`| head`): stop quietly, as Unix tools do; stdout
        # now points at devnull so that the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"vlmpack: error: {given}: choose one of {', '.join(COMMANDS)} "
              "(`vlmpack --help` describes them)", file=sys.stderr)
        return EXIT_USER_ERROR
    name = argv[0]
    target, help_ = COMMANDS[name]
    module_name, attr = target.split(":")
    try:
        command = getattr(importlib.import_module(module_name), attr)
    except KeyboardInterrupt:  # Ctrl-C while the command loads (torch and megatron take seconds): nothing began
        return interrupted_before_start(name)
    parser = _Parser(prog=f"vlmpack {name}", description=help_)
    command.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(command.run(args) or 0)
    except UserError as exc:
        return _fail(name, exc)
    except KeyboardInterrupt:  # Ctrl-C in a command that does not stop on it in its own terms
        print_error(name, "stopped by SIGINT (Ctrl-C) before it finished")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        raise
    except OSError as exc:
        mapped = user_error_from_os_error(exc)
        if mapped is None:
            raise
        return _fail(name, mapped)
    except RuntimeError as exc:
        mapped = user_error_from_symlink_loop(exc)
        if mapped is None:
            raise
        return _fail(name, mapped)


def interrupted_before_start(name: str) -> int:
    """Ctrl-C while a command loads its modules: one line, the status of an interrupted command."""
    print(f"vlmpack {name}: interrupted before it started", file=sys.stderr)
    return EXIT_INTERRUPTED


def _fail(name: str, exc: UserError) -> int:
    """A user error: one line on stderr, the error's exit code, no traceback."""
    print_error(name, exc)
    return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
