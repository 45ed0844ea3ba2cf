"""Errors every `vlmpack` command shares, and the exit code each one means.

A `UserError` is a mistake the person running the command can fix (a bad flag, a missing
directory, an output directory held by another job). The command dispatcher prints its
message as one line and exits 2: never a traceback. `DiskFullError` exits 4, so a batch
scheduler can tell "free space and re-run" from "fix the command".
"""

from __future__ import annotations

import errno

EXIT_USER_ERROR = 2
EXIT_OUT_OF_GPU_MEMORY = 3
EXIT_DISK_FULL = 4


class UserError(Exception):
    """A mistake in the command or its inputs: one line, naming the bad input and the fix."""

    exit_code = EXIT_USER_ERROR


class DiskFullError(UserError):
    """No space left where the command writes; what was complete stays complete."""

    exit_code = EXIT_DISK_FULL


def user_error_from_os_error(exc: OSError) -> UserError | None:
    """The one-line error an OSError means for a person, or None when it is not theirs to fix."""
    where = exc.filename if exc.filename is not None else "the output"
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return DiskFullError(f"no space left on the device writing {where}: free space (or use another --out) and "
                             "re-run the same command; finished work is kept")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UserError(f"permission denied: {where}: choose a directory you can write, or fix its permissions")
    if exc.errno == errno.EROFS:
        return UserError(f"read-only file system: {where}: choose a writable --out")
    if exc.errno == errno.ENOTDIR:
        return UserError(f"not a directory: {where}: a file stands where a directory is needed; pass a directory path")
    if exc.errno == errno.EISDIR:
        return UserError(f"is a directory: {where}: pass a file path")
    if exc.errno == errno.ENOENT:
        return UserError(f"no such file or directory: {where}")
    return None
