"""Damaged copies of model and checkpoint directories for tests: the intact directory with one
file replaced, every other file a link to the intact one (nothing large is copied)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def damaged_copy(intact: Path, out: Path, name: str, damage) -> Path:
    """`out`: `intact` with file `name` (relative) replaced by `damage(its bytes)` (a file `intact`
    lacks: `damage(b"{}")`), every other file a link to the intact one."""
    for path in intact.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            (out / path.relative_to(intact)).parent.mkdir(parents=True, exist_ok=True)
            (out / path.relative_to(intact)).symlink_to(path)
    target = out / name
    raw = target.read_bytes() if target.exists() else b"{}"
    target.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(damage(raw))
    return out


def one_error_line(err: str, command: str) -> str:
    """The error line `vlmpack COMMAND` wrote to stderr `err`, asserting it is the only one and no
    traceback came."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and lines[0].startswith(f"vlmpack {command}: error: "), err
    return lines[0]


def refuse_reads(monkeypatch, paths, modules) -> None:
    """Make `paths` unreadable to this user (chmod 000; the caller restores the modes). Root
    reads any file, so where the tests run as root `open` in each of `modules` refuses them as
    the kernel would refuse anyone else."""
    names = {str(path) for path in paths}
    for path in paths:
        Path(path).chmod(0)
    if os.geteuid() != 0:
        return
    real_open = open

    def refusing_open(file, *args, **kwargs):
        if str(file) in names:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, "open", refusing_open, raising=False)
