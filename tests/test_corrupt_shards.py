"""Damaged shard directories and WebDataset exports through every command, as a user runs them,
and bad command lines for the commands that read them.

Each command runs as its own process on a copy of one small real directory with one kind of
damage. It must stop with a clear one-line error (exit 2; `verify`: its fault report, exit 1),
never a traceback, never a hang. The same commands on the undamaged directory succeed, so every
failure below is the damage's doing, not a bad command line. Bad arguments (missing or wrong
paths, out-of-range values, unknown options) get one line and exit 2 too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions
from shards_schema.cli import COMMANDS
from shards_schema.cli import main as vlmpack
from shards_schema.webdataset import export_webdataset

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 1024
TIMEOUT = 300  # seconds per command: a hang fails the test instead of stalling the suite
DAMAGED_SHARD = "shard-000000.arrow"  # holds sample 0, the one `show` prints
DAMAGED_TAR = "vlmpack-000000.tar"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corrupt")
    rows = example_rows(12, seed=5, size_range=(32, 96))
    out = root / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(root / "chats.jsonl", rows))], out=str(out), workers=1,
                                    rows_per_shard=6, sample=SampleOptions(max_seq_len=SEQ_LEN), progress=False))
    return out


@pytest.fixture(scope="module")
def clean_export(clean, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corrupt-export") / "tars"
    export_webdataset(clean, out, samples_per_tar=4)
    return out


def _pixel_value_offset(path: Path) -> int:
    """File offset of a byte in the middle of the first batch's pixel values: flipping it leaves
    the Arrow file readable, so only a checksum can tell."""
    mm = pa.memory_map(str(path))
    base = mm.read_buffer(1).address
    mm.seek(0)
    values = pa.ipc.open_file(mm).get_batch(0).column("pixel_patches").values.buffers()[1]
    return values.address - base + values.size // 2


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_version(path: Path, key: str) -> None:
    record = json.loads(path.read_text())
    record[key] = 99
    path.write_text(json.dumps(record))


SHARD_DAMAGE = {
    "flipped_byte": lambda d: _flip(d / DAMAGED_SHARD, _pixel_value_offset(d / DAMAGED_SHARD)),
    "truncated": lambda d: (d / DAMAGED_SHARD).write_bytes((d / DAMAGED_SHARD).read_bytes()[:-200]),  # no Arrow footer
    "missing": lambda d: (d / DAMAGED_SHARD).unlink(),
    "manifest_not_json": lambda d: (d / "manifest.json").write_text('{"format": "vlmpack-shards", '),
    "manifest_other_version": lambda d: _other_version(d / "manifest.json", "schema_version"),
    "leftover_tmp": lambda d: (d / "shard-000002.arrow.tmp").write_bytes(b"torn"),
}

TAR_DAMAGE = {
    "flipped_byte": lambda d: _flip(d / DAMAGED_TAR, (d / DAMAGED_TAR).stat().st_size // 2),
    "truncated": lambda d: (d / DAMAGED_TAR).write_bytes((d / DAMAGED_TAR).read_bytes()[:30_000]),
    "missing": lambda d: (d / DAMAGED_TAR).unlink(),
    "index_not_json": lambda d: (d / "index.json").write_text('{"format": "vlmpack-webdataset", '),
    "index_other_version": lambda d: _other_version(d / "index.json", "format_version"),
    "leftover_tmp": lambda d: (d / "vlmpack-000003.tar.tmp").write_bytes(b"torn"),
}


def _command(name: str, data: Path, scratch: Path) -> list[str]:
    return {
        "inspect": ["inspect", str(data)],
        "show": ["show", str(data)],
        "verify": ["verify", str(data)],
        "export": ["export", str(data), "--out", str(scratch / "tars")],
        "import": ["import", str(data), "--out", str(scratch / "imported")],
        "pack": ["pack", str(data), "--seq-len", str(SEQ_LEN)],
        "train": ["train", "--arch", "tiny", "--data", str(data), "--out", str(scratch / "run"), "--seq-len", str(SEQ_LEN),
                  "--train-steps", "1", "--global-batch-packs", "1", "--num-workers", "0", "--tensorboard", "false"],
    }[name]


def _run(name: str, data: Path, scratch: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shards_schema.cli", *_command(name, data, scratch)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _damaged(source: Path, damage, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(source, tmp_path / "damaged"))
    damage(copy)
    return copy


SHARD_COMMANDS = ("inspect", "show", "verify", "export", "pack", "train")

# (damage, command) -> what the one error line (or, for verify, the fault report) must say
SHARD_EXPECTED = {
    ("flipped_byte", "verify"): rf"{DAMAGED_SHARD}: \[sha256_mismatch\]",
    ("flipped_byte", "export"): rf"{DAMAGED_SHARD}: sha256 [0-9a-f]+ does not match manifest\.json",
    **{("truncated", c): rf"{DAMAGED_SHARD}: \d+ bytes, the manifest says \d+ \(truncated"
       for c in ("inspect", "show", "export", "pack", "train")},
    ("truncated", "verify"): rf"{DAMAGED_SHARD}: \[size_mismatch\]",
    **{("missing", c): rf"{DAMAGED_SHARD}: listed in the manifest but missing"
       for c in ("inspect", "show", "export", "pack", "train")},
    ("missing", "verify"): rf"{DAMAGED_SHARD}: \[missing_shard\]",
    **{("manifest_not_json", c): r"manifest\.json: not valid JSON" for c in SHARD_COMMANDS},
    **{("manifest_other_version", c): r"manifest\.json: schema version 99, this vlmpack reads versions 1, 2" for c in SHARD_COMMANDS},
    **{("leftover_tmp", c): r"leftover shard-000002\.arrow\.tmp from an interrupted write"
       for c in ("inspect", "show", "export", "pack", "train")},
    ("leftover_tmp", "verify"): r"shard-000002\.arrow\.tmp: \[leftover_tmp\]",
}


def _assert_stopped(done: subprocess.CompletedProcess, command: str, expected: str) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if command == "verify" and done.returncode == 1:  # damage inside a readable directory: the fault report
        assert "FAILED" in done.stdout and re.search(expected, done.stdout), done.stdout
        return
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"vlmpack {command}: error: "), lines[0]
    assert re.search(expected, lines[0]), lines[0]


@pytest.mark.parametrize("command", SHARD_COMMANDS)
def test_every_command_succeeds_on_the_undamaged_directory(clean, tmp_path, command):
    done = _run(command, clean, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_import_succeeds_on_the_undamaged_export(clean_export, tmp_path):
    done = _run("import", clean_export, tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("damage, command", sorted(SHARD_EXPECTED))
def test_a_damaged_shard_directory_stops_the_command(clean, tmp_path, damage, command):
    data = _damaged(clean, SHARD_DAMAGE[damage], tmp_path)
    done = _run(command, data, tmp_path)
    _assert_stopped(done, command, SHARD_EXPECTED[(damage, command)])
    if command == "verify":
        assert done.returncode == (1 if damage in ("flipped_byte", "truncated", "missing", "leftover_tmp") else 2)
    if command == "export":
        assert not (tmp_path / "tars" / "index.json").exists() and not list((tmp_path / "tars").glob("*.tar"))


TAR_EXPECTED = {
    "flipped_byte": rf"{DAMAGED_TAR}: sha256 [0-9a-f]+ does not match index\.json",
    "truncated": rf"{DAMAGED_TAR}: 30000 bytes, index\.json says \d+ \(truncated",
    "missing": rf"{DAMAGED_TAR}: listed in index\.json but missing",
    "index_not_json": r"index\.json: not valid JSON",
    "index_other_version": r"index\.json: format version 99, this vlmpack reads 1",
    "leftover_tmp": r"leftover vlmpack-000003\.tar\.tmp from an interrupted write",
}


@pytest.mark.parametrize("damage", sorted(TAR_DAMAGE))
def test_a_damaged_export_does_not_import(clean_export, tmp_path, damage):
    tars = _damaged(clean_export, TAR_DAMAGE[damage], tmp_path)
    done = _run("import", tars, tmp_path)
    _assert_stopped(done, "import", TAR_EXPECTED[damage])
    imported = tmp_path / "imported"
    assert not (imported / "manifest.json").exists() and not list(imported.glob("*.arrow"))


def test_a_flipped_pixel_byte_is_caught_by_the_commands_that_hash(clean, tmp_path):
    """The cheap commands read offsets and sizes, never a pixel hash; verify and export hash every shard."""
    data = _damaged(clean, SHARD_DAMAGE["flipped_byte"], tmp_path)
    for command in ("inspect", "show", "pack"):
        done = _run(command, data, tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
    assert _run("verify", data, tmp_path).returncode == 1
    assert _run("export", data, tmp_path).returncode == 2


# ---------------------------------------------------------------------------- bad command lines

# argv (paths: {d} a shard directory, {x} its export, {f} a file, {t} a fresh temporary
# directory) and a part of the one-line error it must give.
BAD_ARGUMENTS = [
    (["inspect"], "the following arguments are required: dir"),
    (["inspect", "{t}/missing"], "{t}/missing: no such directory: pass the shard directory"),
    (["inspect", "{f}"], "{f} is a file, not a directory: pass the shard directory"),
    (["inspect", "{t}"], "{t}: no manifest.json"),
    (["inspect", "{d}", "--plots", "{f}"], "--plots {f} is a file, not a directory"),
    (["inspect", "{d}", "--bogus"], "unrecognized arguments: --bogus"),
    (["show", "{t}/missing"], "{t}/missing: no such directory"),
    (["show", "{f}"], "{f} is a file, not a directory"),
    (["show", "{x}"], "{x}: no manifest.json"),
    (["show", "{d}", "--index", "12"], "--index 12 out of range: {d} holds 12 samples (0..11)"),
    (["show", "{d}", "--index", "-13"], "--index -13 out of range"),
    (["show", "{d}", "--index", "abc"], "argument --index: invalid int value: 'abc'"),
    (["show", "{d}", "--uid", "no-such-uid"], "no sample with sample_uid 'no-such-uid' in {d} (12 samples)"),
    (["show", "{d}", "--index", "1", "--uid", "x"], "argument --uid: not allowed with argument --index"),
    (["show", "{d}", "--color", "--no-color"], "argument --no-color: not allowed with argument --color"),
    (["show", "{d}", "--model", "{t}/missing"], "--model {t}/missing: no tokenizer.json there"),
    (["show", "{d}", "--save-images", "{f}"], "--save-images {f} is a file, not a directory"),
    (["verify", "{t}/missing"], "{t}/missing: no such directory"),
    (["verify", "{f}"], "{f} is a file, not a directory"),
    (["verify", "{t}"], "{t}: no manifest.json"),
    (["verify", "{d}", "--workers", "0"], "--workers must be at least 1, got 0"),
    (["verify", "{d}", "--workers", "many"], "argument --workers: invalid int value: 'many'"),
    (["verify", "{d}", "--max-faults", "-1"], "--max-faults must be 0 or more, got -1"),
    (["export", "{d}"], "the following arguments are required: --out"),
    (["export", "{t}/missing", "--out", "{t}/o"], "{t}/missing: no such directory"),
    (["export", "{f}", "--out", "{t}/o"], "{f} is a file, not a directory"),
    (["export", "{x}", "--out", "{t}/o"], "{x}: no manifest.json"),
    (["export", "{d}", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["export", "{d}", "--out", "{d}"], "--out {d} is the input directory"),
    (["export", "{d}", "--out", "{t}/o", "--format", "parquet"], "argument --format: invalid choice: 'parquet'"),
    (["export", "{d}", "--out", "{t}/o", "--samples-per-tar", "0"], "--samples-per-tar must be at least 1, got 0"),
    (["export", "{d}", "--out", "{t}/o", "--samples-per-tar", "few"], "argument --samples-per-tar: invalid int value: 'few'"),
    (["export", "{d}", "--out", "{t}/o", "--max-tar-bytes", "lots"], "argument --max-tar-bytes: 'lots' is not a size"),
    (["export", "{d}", "--out", "{t}/o", "--max-tar-bytes", "0"], "--max-tar-bytes must be positive, got 0"),
    (["import", "{x}"], "the following arguments are required: --out"),
    (["import", "{t}/missing", "--out", "{t}/o"], "{t}/missing: no such directory: pass the directory written by `vlmpack export`"),
    (["import", "{f}", "--out", "{t}/o"], "{f} is a file, not a directory"),
    (["import", "{d}", "--out", "{t}/o"], "{d}: no index.json"),
    (["import", "{x}", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["import", "{x}", "--out", "{x}"], "--out {x} is the input directory"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line_and_exit_2(clean, clean_export, tmp_path, capsys, argv, message):
    scratch = tmp_path / "t"
    scratch.mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    paths = {"d": clean, "x": clean_export, "f": tmp_path / "a-file", "t": scratch}
    argv = [a.format(**paths) for a in argv]
    try:
        code = vlmpack(argv)
    except SystemExit as exc:  # argparse's own errors exit from the parser
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"vlmpack {argv[0]}: error: ") and message.format(**paths) in err, err
    assert paths["f"].read_text() == "not a directory"  # a file passed for a directory is never written


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command_has_help(command):
    module, attr = COMMANDS[command][0].split(":")
    parser = argparse.ArgumentParser(prog=command)
    getattr(importlib.import_module(module), attr).add_arguments(parser)
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{command}: {action.option_strings or action.dest} has no help"
