"""Errors every `vlmpack` command shares, and the exit code each one means.

A `UserError` is a mistake the person running the command can fix (a bad flag, a missing
directory, an output directory held by another job). The command dispatcher prints its
message as one line and exits 2: never a traceback. `DiskFullError` exits 4, so a batch
scheduler can tell "free space and re-run" from "fix the command". `EXIT_CODES` is every exit
status a command gives; the docs list exactly these (tests/test_docs_codes.py).
"""

from __future__ import annotations

import errno
import signal
import sys

EXIT_OK = 0
EXIT_FAULT = 1
EXIT_USER_ERROR = 2
EXIT_OUT_OF_GPU_MEMORY = 3
EXIT_DISK_FULL = 4
EXIT_SIGNAL_BASE = 128  # + the signal's number: what a shell reports for a command a signal ended
EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + signal.SIGINT  # 130: Ctrl-C
EXIT_BROKEN_PIPE = EXIT_SIGNAL_BASE + signal.SIGPIPE  # 141: the reader of the output has gone
SIGNAL_EXIT = "128+N"  # EXIT_CODES' key for any signal's status, spelt as the docs spell it

# Every exit status of a `vlmpack` command, with what it means.
EXIT_CODES: dict[int | str, str] = {
    EXIT_OK: "success (also `train` stopped by SIGTERM or SIGUSR1 with the step saved: a preemption to requeue)",
    EXIT_FAULT: "a fault found: a job that wrote nothing or lost a worker to SIGKILL or a crash, `verify` found "
                "faults, `fetch` found a shard unlike its manifest, `train --dry-run` found no layout that fits, or "
                "the storage failed a read or write (an input/output error)",
    EXIT_USER_ERROR: "a user error: a mistake in the command or its inputs (one line naming it and the fix)",
    EXIT_OUT_OF_GPU_MEMORY: "out of GPU memory",
    EXIT_DISK_FULL: "disk full: free space and re-run; finished work is kept",
    SIGNAL_EXIT: "stopped by signal N (SIGTERM, SIGINT, SIGHUP; to `train` a second signal): re-run to resume",
    EXIT_INTERRUPTED: "Ctrl-C (128 + SIGINT)",
    EXIT_BROKEN_PIPE: "output piped into a reader that has gone (128 + SIGPIPE)",
}


def signal_exit_code(signum: int) -> int:
    """The exit status of a command stopped by signal `signum` (128 + N, as a shell reports it)."""
    return EXIT_SIGNAL_BASE + int(signum)


class UserError(Exception):
    """A mistake in the command or its inputs: one line, naming the bad input and the fix."""

    exit_code = EXIT_USER_ERROR


def first_few(names: list[str], sep: str = ", ") -> str:
    """The first three of `names` and how many more: a listing that stays one line."""
    if len(names) <= 3:
        return sep.join(names)
    return sep.join(names[:3]) + ("" if sep == ", " else sep.rstrip()) + f" and {len(names) - 3} more"


def print_error(command: str, message) -> None:
    """`vlmpack COMMAND: error: MESSAGE` as one line on stderr: a line break inside the message
    (from a path or a value the user gave) is shown escaped."""
    text = str(message).replace("\r", "\\r").replace("\n", "\\n")
    print(f"vlmpack {command}: error: {text}", file=sys.stderr)


class DiskFullError(UserError):
    """No space left where the command writes; what was complete stays complete."""

    exit_code = EXIT_DISK_FULL


class StorageFault(UserError):
    """The storage failed a read or write (EIO: a failing disk, a network file system gone): no
    mistake of the command's, a fault (exit 1) to fix before the same command is run again."""

    exit_code = EXIT_FAULT


def user_error_from_os_error(exc: OSError) -> UserError | None:
    """The one-line error an OSError means for a person, or None when it is not theirs to fix."""
    where = exc.filename if exc.filename is not None else "the output"
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return DiskFullError(f"no space left on the device writing {where}: free space (or use another --out) and "
                             "re-run the same command; finished work is kept")
    if exc.errno == errno.EIO:
        return StorageFault(f"input/output error at {where}: the storage failed (a failing disk, or a network file "
                            "system that went away); check it, then re-run the same command; finished work is kept")
    if exc.errno == errno.EFBIG:
        return UserError(f"file too large: {where}: a file reached the size limit of its file system or of this "
                         "process (`ulimit -f`); raise the limit or choose a file system without it, then re-run the "
                         "same command")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UserError(f"permission denied: {where}: this user may not open it; fix its permissions, or choose "
                         "a path this user can read and write")
    if exc.errno == errno.EROFS:
        return UserError(f"read-only file system: {where}: choose a writable --out")
    if exc.errno == errno.ENOTDIR:
        return UserError(f"not a directory: {where}: a file stands where a directory is needed; pass a directory path")
    if exc.errno == errno.EISDIR:
        return UserError(f"is a directory: {where}: pass a file path")
    if exc.errno == errno.ENOENT:
        return UserError(f"no such file or directory: {where}")
    if exc.errno == errno.ENAMETOOLONG:
        return UserError(f"file name too long: {where}: a name in a path may have at most 255 bytes; choose a "
                         "shorter one")
    if exc.errno == errno.ELOOP:
        return UserError(f"symbolic link loop: {where}: a link in the path leads back to itself; fix or remove it")
    return None


def user_error_from_symlink_loop(exc: RuntimeError) -> UserError | None:
    """pathlib's resolve() of a link that leads back to itself (a RuntimeError before Python
    3.13, an OSError after) as a user error; None for any other RuntimeError."""
    text = str(exc)
    if not text.startswith("Symlink loop from "):
        return None
    return UserError(f"symbolic link loop: {text.removeprefix('Symlink loop from ')}: a link in the path leads back "
                     "to itself; fix or remove it")
