"""Output directories that one job owns at a time.

Every command that writes a directory (preprocess, merge, import, export, train's --out)
takes an exclusive lock on it first: `flock` on `DIR/.vlmpack.lock`, which the kernel
releases when the process dies however it dies (kill -9 included), so a stale lock never
blocks a re-run. The lock file also records who holds it, so the second job's message
names the first.

A directory a command refuses is left exactly as it was found: its `check` (what the command
would refuse: another job's output, files it did not write) runs before the lock file is
created in a directory that exists, and again once the lock is held. A directory the job
made and then failed in before writing any file (a refused input found under the lock) is
removed again, with the parents it made for it, so a refused run leaves no empty --out behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError, first_few

LOCK_NAME = ".vlmpack.lock"


def prepare_output_dir(path: str | Path, *, what: str = "--out") -> Path:
    """Create `path` (and parents) as a directory, or explain in one line why it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory: pass a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise UserError(f"{what} {path}: a file stands in the path ({exc.filename}): pass a directory path") from None
    except PermissionError:
        raise UserError(f"{what} {path}: permission denied creating it: choose a directory you can write") from None
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot create it ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path} is not writable: choose a directory you can write, or fix its permissions")
    return path


def outermost_missing(path: str | Path) -> Path | None:
    """The outermost directory of `path` (itself or a parent) that does not exist yet, the first
    one that creating `path` with its parents makes; None where `path` exists. Read from the
    path as given (not resolved), so that each step is the one the system walks."""
    path = Path(path)
    if os.path.lexists(path):
        return None
    top = path
    for parent in path.parents:
        if os.path.lexists(parent):
            break
        top = parent
    return top


def remove_made_parents(path: str | Path, top: Path | None) -> None:
    """Remove the parents of `path` up to `top` (`outermost_missing` before they were made)
    while they are empty: the directories a job made only to reach `path`, which is gone."""
    if top is None:
        return
    chain = [Path(path), *Path(path).parents]
    for directory in chain[1:chain.index(top) + 1] if top in chain else []:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (something else was put there), or not ours to remove


def refuse_input_as_output(out: str | Path, source: str | Path, what: str = "--out") -> None:
    """--out may be neither the command's input directory nor inside it (what it writes would
    mix with what it reads)."""
    resolved, input_dir = Path(out).resolve(), Path(source).resolve()
    if resolved == input_dir:
        raise UserError(f"{what} {out} is the input directory: choose another directory")
    if input_dir in resolved.parents:
        raise UserError(f"{what} {out} lies inside the input directory {source}: choose a directory outside it")


def recorded_command(path: Path) -> str | None:
    """The command recorded in `path`'s lock file by the last job that held it (None: no lock
    file, or not one of ours)."""
    try:
        return json.loads((Path(path) / LOCK_NAME).read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):
        return None


# a job's record name where it is no command of its own: what a user typed to make that output
COMMAND_SHOWN = {"export-peft": "export-hf (of LoRA adapters, in PEFT's format)"}


def shown_command(record: str | None) -> str:
    """The `vlmpack` command a lock file's record names, as a user runs it."""
    return COMMAND_SHOWN.get(record, record)


def user_entries(path: Path) -> list[str]:
    """Names in `path` other than the lock file: what makes a directory non-empty to a job."""
    return sorted(name for name in os.listdir(path) if name != LOCK_NAME)


@contextmanager
def exclusive_output_dir(path: str | Path, command: str, *, what: str = "--out", check=None):
    """Hold `path` for this process until the block ends; UserError if another job holds it.

    Yields the directory as a Path (created if needed). `check(path)`, if given, raises the
    command's refusal of an existing directory: it runs before anything is written there, and
    again under the lock (another job may have changed the directory in between).
    """
    if check is not None and Path(path).is_dir() and not _held(Path(path) / LOCK_NAME):
        check(Path(path))  # (a held directory is refused as in use, below: what it holds may be changing)
    top = outermost_missing(path)
    path = prepare_output_dir(path, what=what)
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot create the lock file {LOCK_NAME} ({exc.strerror}): "
                        "choose a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{what} {path} is in use by another job ({_holder(fd)}): wait for it to finish, "
                            "or choose another directory") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder, ensure_ascii=True) + "\n").encode(), 0)
        if check is not None:
            check(path)
        yield path
    except BaseException:
        if top is not None:
            _remove_if_unwritten(path)  # still under the lock: no other job can be starting in it
            if not os.path.lexists(path):
                remove_made_parents(path, top)
        raise
    finally:
        os.close(fd)  # closing the descriptor releases the flock


@contextmanager
def viewer_output_dir(path: str | Path, command: str, what: str, owned: re.Pattern):
    """Hold the directory where a command writes files for a person to look at (`inspect
    --plots`, `show --save-images`), as `exclusive_output_dir` does: it must be empty, or hold
    only regular files of `owned` names that the same command wrote (its lock file's record),
    which it adds to or replaces. A user's file, or a link, is never written over or through."""

    def check(directory: Path) -> None:
        entries = user_entries(directory)
        foreign = [name for name in entries if not (owned.fullmatch(name) and (directory / name).is_file()
                                                    and not (directory / name).is_symlink())]
        if foreign or (entries and recorded_command(directory) != command):
            raise UserError(f"{what} {directory} holds files that `vlmpack {command} {what}` did not write "
                            f"({first_few(foreign or entries)}): choose an empty or new directory")

    with exclusive_output_dir(path, command, what=what, check=check) as directory:
        yield directory


def _held(lock_path: Path) -> bool:
    """Whether a job holds the lock file `lock_path` now (its lock taken, not only its record)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the shared lock just taken


def _remove_if_unwritten(path: Path) -> None:
    """Remove `path` if it holds nothing but the lock file and empty directories."""
    directories = []
    for root, _, files in os.walk(path, topdown=False):
        if any(name != LOCK_NAME or Path(root) != path for name in files):
            return
        directories.append(root)
    try:
        os.unlink(path / LOCK_NAME)
        for directory in directories:  # deepest first: os.walk bottom-up
            os.rmdir(directory)
    except OSError:
        pass  # best effort: what is left is empty and does not block a re-run


def _holder(fd: int, wait_s: float = 2.0) -> str:
    # The holder writes its record right after taking the lock, so a job that loses the race
    # by microseconds can find the file empty or half-written: poll briefly for a whole record.
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode())
            if isinstance(info, dict) and "pid" in info:
                break
        except (ValueError, OSError):
            pass
        if time.monotonic() >= deadline:
            return "holder not recorded"
        time.sleep(0.01)
    return (f"vlmpack {info.get('command', '?')}, pid {info.get('pid', '?')} on {info.get('host', '?')}, "
            f"since {info.get('started', '?')}")
