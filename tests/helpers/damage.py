"""Damaged copies of model and checkpoint directories for tests: the intact directory with one
file replaced, every other file a link to the intact one (nothing large is copied)."""

from __future__ import annotations

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
