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
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions
from shards_schema import open_shards
from shards_schema.cli import COMMANDS
from shards_schema.cli import main as vlmpack
from shards_schema.reader import ShardFault
from shards_schema.verify import verify_shards
from shards_schema.webdataset import export_webdataset
from tests.helpers.damage import refuse_reads

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


def _flip(path: Path, at: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def _other_version(path: Path, key: str) -> None:
    record = json.loads(path.read_text())
    record[key] = 99
    path.write_text(json.dumps(record))


def _edit_index(d: Path, edit) -> None:
    index = json.loads((d / "index.json").read_text())
    edit(index)
    (d / "index.json").write_text(json.dumps(index))


def _edit_manifest(d: Path, edit) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))  # NaN and Infinity as Python's json writes them


def _arrow_regions(path: Path) -> dict[str, range]:
    """File offsets of the parts of an Arrow IPC file that hold metadata: the first record batch's
    header (lengths, field nodes, buffer offsets and lengths) and the footer (the schema readers
    use, the record batch blocks, the footer length and closing magic)."""
    data = path.read_bytes()
    schema_at = 8  # after the 8-byte "ARROW1\0\0" magic: continuation, metadata length, metadata
    batch_at = schema_at + 8 + struct.unpack_from("<i", data, schema_at + 4)[0]
    body_at = batch_at + 8 + struct.unpack_from("<i", data, batch_at + 4)[0]
    footer_at = len(data) - 10 - struct.unpack_from("<i", data, len(data) - 10)[0]
    return {"batch_header": range(batch_at, body_at), "footer": range(footer_at, len(data)), "body_at": body_at}


def _buffer_length_offset(path: Path, column: str) -> int:
    """File offset of the length of `column`'s values buffer, in the first record batch's header."""
    mm = pa.memory_map(str(path))
    base = mm.read_buffer(1).address
    mm.seek(0)
    values = pa.ipc.open_file(mm).get_batch(0).column(column).values.buffers()[1]
    regions = _arrow_regions(path)
    entry = struct.pack("<qq", values.address - base - regions["body_at"], values.size)  # (offset, length) in the body
    header = regions["batch_header"]
    at = path.read_bytes().index(entry, header.start, header.stop)
    return at + 8


SHARD_DAMAGE = {
    "flipped_byte": lambda d: _flip(d / DAMAGED_SHARD, _pixel_value_offset(d / DAMAGED_SHARD)),
    "truncated": lambda d: (d / DAMAGED_SHARD).write_bytes((d / DAMAGED_SHARD).read_bytes()[:-200]),  # no Arrow footer
    "missing": lambda d: (d / DAMAGED_SHARD).unlink(),
    "manifest_not_json": lambda d: (d / "manifest.json").write_text('{"format": "vlmpack-shards", '),
    "manifest_other_version": lambda d: _other_version(d / "manifest.json", "schema_version"),
    "manifest_version_a_string": lambda d: _edit_manifest(d, lambda m: m.update(schema_version=str(m["schema_version"]))),
    "manifest_version_zero": lambda d: _edit_manifest(d, lambda m: m.update(schema_version=0)),
    "leftover_tmp": lambda d: (d / "shard-000002.arrow.tmp").write_bytes(b"torn"),
    # one byte of the schema's metadata in the footer (the copy readers use): a key no longer reads
    # `vlmpack.patch_row_width`
    "flipped_schema_byte": lambda d: _flip(d / DAMAGED_SHARD, (d / DAMAGED_SHARD).read_bytes().rindex(b"vlmpack.patch_row_width")),
    # the pixel values buffer's length in the record batch header grows by 2^40 (a terabyte)
    "flipped_buffer_length": lambda d: _flip(d / DAMAGED_SHARD, _buffer_length_offset(d / DAMAGED_SHARD, "pixel_patches") + 5, 0x01),
    "zero_length": lambda d: (d / DAMAGED_SHARD).write_bytes(b""),
    "shard_is_directory": lambda d: ((d / DAMAGED_SHARD).unlink(), (d / DAMAGED_SHARD).mkdir()),
    "shard_is_fifo": lambda d: ((d / DAMAGED_SHARD).unlink(), os.mkfifo(d / DAMAGED_SHARD)),  # opening it would block
    "manifest_nan_rows": lambda d: _edit_manifest(d, lambda m: m["shards"][0].update(rows=float("nan"))),
    "manifest_shard_twice": lambda d: _edit_manifest(d, lambda m: m["shards"].append(m["shards"][0])),
    # the shards are whole version-2 files: the edited manifest is what differs
    "manifest_version_lowered": lambda d: _edit_manifest(d, lambda m: m.update(schema_version=1)),
    "manifest_without_totals": lambda d: _edit_manifest(d, lambda m: m.pop("totals")),
    "manifest_is_directory": lambda d: ((d / "manifest.json").unlink(), (d / "manifest.json").mkdir()),
    "manifest_is_fifo": lambda d: ((d / "manifest.json").unlink(), os.mkfifo(d / "manifest.json")),
}

TAR_DAMAGE = {
    "flipped_byte": lambda d: _flip(d / DAMAGED_TAR, (d / DAMAGED_TAR).stat().st_size // 2),
    "truncated": lambda d: (d / DAMAGED_TAR).write_bytes((d / DAMAGED_TAR).read_bytes()[:30_000]),
    "missing": lambda d: (d / DAMAGED_TAR).unlink(),
    "index_not_json": lambda d: (d / "index.json").write_text('{"format": "vlmpack-webdataset", '),
    "index_other_version": lambda d: _other_version(d / "index.json", "format_version"),
    "leftover_tmp": lambda d: (d / "vlmpack-000003.tar.tmp").write_bytes(b"torn"),
    # index.json edited by hand: fields of the wrong kind are named, never a traceback
    "index_version_a_string": lambda d: _edit_index(d, lambda i: i.update(format_version="1")),
    "index_tars_null": lambda d: _edit_index(d, lambda i: i.update(tars=None)),
    "index_manifest_a_string": lambda d: _edit_index(d, lambda i: i.update(manifest="shards/")),
    "index_rejects_null": lambda d: _edit_index(d, lambda i: i.update(rejects=None)),
    "index_offsets_not_counts": lambda d: _edit_index(d, lambda i: i["tars"][0].update(
        sample_offsets=["x"] * i["tars"][0]["samples"])),
    "index_samples_a_string": lambda d: _edit_index(d, lambda i: i.update(samples=str(i["samples"]))),
    "index_without_tars": lambda d: _edit_index(d, lambda i: i.pop("tars")),
    "index_is_fifo": lambda d: ((d / "index.json").unlink(), os.mkfifo(d / "index.json")),
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
READERS = ("inspect", "show", "export", "pack", "train")
SHARD_EXPECTED = {
    ("flipped_byte", "verify"): rf"{DAMAGED_SHARD}: \[sha256_mismatch\]",
    ("flipped_byte", "export"): rf"{DAMAGED_SHARD}: \[sha256_mismatch\] sha256 [0-9a-f]+ does not match manifest\.json",
    **{("truncated", c): rf"{DAMAGED_SHARD}: \[size_mismatch\] [\d,]+ bytes on disk, the manifest says [\d,]+ \(truncated"
       for c in READERS},
    ("truncated", "verify"): rf"{DAMAGED_SHARD}: \[size_mismatch\]",
    **{("missing", c): rf"{DAMAGED_SHARD}: \[missing_shard\] listed in manifest\.json but missing" for c in READERS},
    ("missing", "verify"): rf"{DAMAGED_SHARD}: \[missing_shard\]",
    # every reader names the file and the fault as verify does: `FILE: [kind] what`
    **{("flipped_schema_byte", c): rf"{DAMAGED_SHARD}: \[schema_mismatch\] schema metadata: patch_row_width ''"
       for c in (*READERS, "verify")},
    **{("flipped_buffer_length", c): rf"{DAMAGED_SHARD}: \[unreadable_shard\] record batch 0 is damaged"
       for c in (*READERS, "verify")},
    **{("zero_length", c): rf"{DAMAGED_SHARD}: \[size_mismatch\] 0 bytes on disk" for c in (*READERS, "verify")},
    **{("shard_is_directory", c): rf"{DAMAGED_SHARD}: \[not_a_file\] a directory stands where manifest\.json lists"
       for c in (*READERS, "verify")},
    **{("shard_is_fifo", c): rf"{DAMAGED_SHARD}: \[not_a_file\] a FIFO stands where" for c in (*READERS, "verify")},
    **{("manifest_nan_rows", c): rf"manifest\.json: shards\[0\] \({DAMAGED_SHARD}\) has missing or invalid rows nan"
       for c in READERS},
    ("manifest_nan_rows", "verify"): rf"{DAMAGED_SHARD}: \[manifest_field\] manifest\.json: shards\[0\]",
    **{("manifest_shard_twice", c): rf"manifest\.json: {DAMAGED_SHARD} is listed twice" for c in READERS},
    ("manifest_shard_twice", "verify"): rf"{DAMAGED_SHARD}: \[manifest_field\] manifest\.json: {DAMAGED_SHARD} is listed twice",
    **{("manifest_not_json", c): r"manifest\.json: not valid JSON" for c in SHARD_COMMANDS},
    **{("manifest_other_version", c): r"manifest\.json: schema version 99, this vlmpack reads versions 1, 2; a newer "
                                       r"vlmpack wrote it: upgrade vlmpack" for c in SHARD_COMMANDS},
    **{("manifest_version_zero", c): r"manifest\.json: schema version 0, this vlmpack reads versions 1, 2; no vlmpack "
                                      r"writes schema version 0: the manifest is damaged" for c in ("inspect", "verify")},
    **{("manifest_version_a_string", c): r"manifest\.json: schema_version '2' is not an integer: the manifest is damaged"
       for c in SHARD_COMMANDS},
    **{("manifest_version_lowered", c): rf"{DAMAGED_SHARD}: \[schema_mismatch\] schema metadata: schema_version '2' "
                                         r"\(manifest: 1\): the file is a whole version-2 shard, so manifest\.json's "
                                         r"schema_version 1 was changed: set it back to 2 \(or restore manifest\.json\)"
       for c in ("inspect", "verify")},
    ("manifest_without_totals", "inspect"): r"manifest\.json: `totals` must be an object, and it is missing",
    **{("manifest_is_directory", c): r"manifest\.json is a directory, not the manifest file"
       for c in ("inspect", "verify", "train")},
    **{("manifest_is_fifo", c): r"manifest\.json is a FIFO \(named pipe\), not a regular file"
       for c in ("inspect", "verify")},
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


# train reads shards through the loader's setup, the same reader every other command uses, but
# starts the trainer's imports first (seconds each): every run checks it on one damage of each
# kind (a shard's size, its record batches, a FIFO, the manifest), the sweep on the rest.
TRAIN_EVERY_RUN = {"truncated", "flipped_buffer_length", "shard_is_fifo", "manifest_not_json"}


@pytest.mark.parametrize("damage, command", [
    case if case[1] != "train" or case[0] in TRAIN_EVERY_RUN else pytest.param(*case, marks=pytest.mark.sweep)
    for case in sorted(SHARD_EXPECTED)])
def test_a_damaged_shard_directory_stops_the_command(clean, tmp_path, damage, command):
    data = _damaged(clean, SHARD_DAMAGE[damage], tmp_path)
    done = _run(command, data, tmp_path)
    _assert_stopped(done, command, SHARD_EXPECTED[(damage, command)])
    if command == "verify":
        assert done.returncode == (2 if damage in ("manifest_not_json", "manifest_other_version", "manifest_version_zero",
                                                   "manifest_version_a_string", "manifest_is_directory",
                                                   "manifest_is_fifo") else 1)
    if command == "export":
        assert not (tmp_path / "tars" / "index.json").exists() and not list((tmp_path / "tars").glob("*.tar"))
    if not damage.startswith("manifest_"):  # the shard is named, an intact manifest never blamed
        assert not re.search(r"manifest\.json(: | is malformed)", done.stderr + done.stdout), done.stderr + done.stdout


def test_a_manifest_schema_version_changed_over_whole_shards_is_named_as_the_manifests(clean, tmp_path):
    """A manifest whose schema_version was changed by hand over intact shards of another version
    (1 over version-2 shards): the readers' line and verify's fault name manifest.json's number
    and the version to set back, never a shard to restore."""
    data = _damaged(clean, SHARD_DAMAGE["manifest_version_lowered"], tmp_path)
    with pytest.raises(ShardFault) as err:
        open_shards(data).open_all()
    assert str(err.value).startswith(f"{data / DAMAGED_SHARD}: [schema_mismatch] schema metadata: schema_version '2' "
                                      "(manifest: 1): the file is a whole version-2 shard, so manifest.json's "
                                      "schema_version 1 was changed: set it back to 2 (or restore manifest.json) and "
                                      "check the directory with `vlmpack verify "), str(err.value)
    assert "restore the file" not in str(err.value)
    report = verify_shards(data, quick=True)
    assert set(report.fault_counts) == {"schema_mismatch"} and report.faults, report.faults
    assert all(f.message.endswith("set it back to 2 (or restore manifest.json)") for f in report.faults), report.faults


# Flipped bytes across the Arrow metadata of the damaged shard, each through every reading
# command in one process (the commands run in-process there, one after the other). Its memory
# is capped at what it holds plus 2 GiB once everything is imported, so a length field that asks
# for terabytes fails the test instead of the machine; a crash shows as the process dying.
METADATA_SWEEP = r"""
import contextlib, io, json, os, resource, shutil, sys
from pathlib import Path

clean, work, damaged, positions = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
import preprocess.show, shards_schema.inspect, shards_schema.verify, shards_schema.webdataset.command, train.cli
from shards_schema import ShardFormatError
from shards_schema.cli import main as vlmpack
from shards_schema.reader import ShardFault
from train.loader import PackedLoader
from train.pack_plan import PackSettings

tokenizers = []  # the same tokenizer serves every copy: `show` loads it once (seconds), not per flip
load_tokenizer = preprocess.show.load_tokenizer


def load_tokenizer_once(*args):
    if not tokenizers:
        tokenizers.append(load_tokenizer(*args))
    return tokenizers[0]


preprocess.show.load_tokenizer = load_tokenizer_once
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
results = []
for n, (at, mask) in enumerate(positions):
    print(f"position {at} ^ {mask:#x}", flush=True)  # the last one printed names a crash
    data_dir = work / f"d{n}"
    shutil.copytree(clean, data_dir)
    shard = data_dir / damaged
    data = bytearray(shard.read_bytes())
    data[at] ^= mask
    shard.write_bytes(bytes(data))
    for argv in (["inspect", data_dir], ["show", data_dir], ["pack", data_dir, "--seq-len", "1024"],
                 ["verify", data_dir, "--quick"], ["export", data_dir, "--out", work / f"tars{n}"]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = vlmpack([str(a) for a in argv])
        results.append({"at": at, "command": argv[0], "code": code, "out": out.getvalue()[-3000:], "err": err.getvalue()})
    try:
        PackedLoader([str(data_dir)], PackSettings(seq_len=1024, global_batch_packs=1)).dataset()
        results.append({"at": at, "command": "loader", "code": 0, "out": "", "err": ""})
    except ShardFormatError as exc:
        results.append({"at": at, "command": "loader", "code": 2, "out": "", "err": f"vlmpack loader: error: {exc}\n"})
    shutil.rmtree(data_dir)
print("RESULTS " + json.dumps(results))
"""


def _metadata_positions(path: Path) -> list[tuple[int, int]]:
    """A spread of (offset, xor mask) over the first record batch's header and the footer."""
    regions = _arrow_regions(path)
    header, footer = regions["batch_header"], regions["footer"]
    picks = [header[i * len(header) // 5] for i in range(5)] + [footer[i * len(footer) // 6] for i in range(6)]
    picks += [footer.stop - 10, footer.stop - 3]  # the footer's length, the closing magic
    picks.append(_buffer_length_offset(path, "input_ids"))
    return [(at, (0xFF, 0x01, 0x80, 0x10)[i % 4]) for i, at in enumerate(picks)]


def test_flipped_bytes_in_the_arrow_metadata_are_named_by_every_reader(clean, tmp_path):
    positions = _metadata_positions(clean / DAMAGED_SHARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", METADATA_SWEEP, str(clean), str(tmp_path), DAMAGED_SHARD,
                           json.dumps(positions)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and "RESULTS " in done.stdout, (done.returncode, done.stdout[-500:], done.stderr[-3000:])
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])
    stopped = set()
    for r in results:
        where = f"{r['command']} with the byte at {r['at']} flipped"
        assert "Traceback" not in r["err"] + r["out"], (where, r["err"])
        if r["command"] == "verify":  # --quick: the structure checks the readers make, no sha256
            assert r["code"] in (0, 1) and (r["code"] == 0 or f"FAULT {DAMAGED_SHARD}: [" in r["out"]), (where, r)
            continue
        assert r["code"] in (0, 2), (where, r)
        if r["code"] == 2:
            stopped.add(r["at"])
            lines = r["err"].strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"vlmpack {r['command']}: error: "), (where, r["err"])
            assert re.search(rf"{DAMAGED_SHARD}(?: row \d+)?: \[\w+\] ", lines[0]), (where, lines[0])
            assert "vlmpack verify" in lines[0], (where, lines[0])
        elif r["command"] == "export":  # export hashes each shard: no flipped byte gets through
            raise AssertionError((where, r))
    assert len(stopped) >= len(positions) // 2, f"only {len(stopped)} of {len(positions)} flips were noticed"


# Each numeric field a reader relies on, and the text the one-line error must name it by.
MANIFEST_NUMBERS = {
    ("shards", 0, "rows"): "shards[0] (shard-000000.arrow) has missing or invalid rows",
    ("shards", 0, "bytes"): "shards[0] (shard-000000.arrow) has missing or invalid bytes",
    ("shards", 1, "patches"): "shards[1] (shard-000001.arrow) has missing or invalid patches",
    ("patch_row_width",): "patch_row_width",
    ("totals", "tokens"): "totals need integers 0..2^53: tokens",
    ("accounting", "rows_read"): "accounting needs integers 0..2^53: rows_read",
    ("accounting", "rejects_by_reason"): "accounting needs integers 0..2^53: rejects_by_reason",
    ("accounting", "inputs", 0, "rows"): "accounting needs integers 0..2^53: inputs[0].rows",
    ("profile", "vision", "merge_size"): "profile.vision.merge_size",
    ("profile", "vision", "image_std", 1): "profile.vision.image_std",
    ("profile", "special_tokens", "image_pad"): "profile.special_tokens need token ids",
    ("profile", "tokens_per_second"): "profile.tokens_per_second",
}
NOT_COUNTS = (-1, 2**70, float("nan"), float("inf"), 1.5, "7", None)


@pytest.mark.parametrize("field", list(MANIFEST_NUMBERS), ids=[".".join(map(str, f)) for f in MANIFEST_NUMBERS])
def test_a_manifest_number_out_of_range_is_named_by_every_reader(clean, tmp_path, capsys, field):
    """Negative, huge, NaN, infinite, fractional, quoted or null numbers in the manifest: the
    readers name the field in one line (exit 2) before any of it sizes an array or a read;
    verify reports it (exit 1)."""
    data = Path(shutil.copytree(clean, tmp_path / "data"))
    original = json.loads((clean / "manifest.json").read_text())
    bad_values = NOT_COUNTS if field[-2:] != ("image_std", 1) else (float("nan"), float("inf"), 0, "7", None)
    for value in bad_values:
        manifest = json.loads(json.dumps(original))
        parent = manifest
        for key in field[:-1]:
            parent = parent[key]
        parent[field[-1]] = value
        (data / "manifest.json").write_text(json.dumps(manifest))
        for argv in (["inspect", data], ["show", data], ["pack", data, "--seq-len", "1024"], ["export", data, "--out",
                                                                                           tmp_path / "tars"]):
            code = vlmpack([str(a) for a in argv])
            out, err = capsys.readouterr()
            assert code == 2 and out == "" and err.count("\n") == 1, (argv[0], value, code, out, err)
            assert f"{data}/manifest.json: {MANIFEST_NUMBERS[field]}" in err, (argv[0], value, err)
        assert vlmpack(["verify", str(data), "--quick"]) == 1, value
        out, err = capsys.readouterr()
        assert "FAILED" in out and "Traceback" not in err, (value, out, err)


@pytest.mark.parametrize("key", ["chat_template", "chat_template_sha256"])
def test_a_chat_template_that_is_not_text_is_named_by_every_reader(clean, tmp_path, capsys, key):
    """The profile's chat template goes into every export of a model trained on the shards: a
    number, list or object there is named when the shards are read, not after training."""
    data = Path(shutil.copytree(clean, tmp_path / "data"))
    original = json.loads((clean / "manifest.json").read_text())
    for value in (5, ["{{ x }}"], {"default": "{{ x }}"}, True):
        manifest = json.loads(json.dumps(original))
        manifest["profile"][key] = value
        (data / "manifest.json").write_text(json.dumps(manifest))
        for argv in (["inspect", data], ["show", data], ["pack", data, "--seq-len", "1024"],
                     ["train", "--data", data, "--arch", "tiny", "--dry-run"]):
            code = vlmpack([str(a) for a in argv])
            out, err = capsys.readouterr()
            assert code == 2 and err.count("\n") == 1, (argv[0], value, code, err)
            assert f"profile.{key} is not a string but a {type(value).__name__}" in err, (argv[0], value, err)
        assert vlmpack(["verify", str(data), "--quick"]) == 1, value
        assert "FAILED" in capsys.readouterr().out


def test_a_row_whose_columns_disagree_is_named_by_the_commands_that_read_rows(clean, tmp_path, capsys):
    """A shard rewritten consistently (sizes, sha256, stats) but with one row's loss_mask a token
    short and another row's pixel patches a patch short: the commands that read rows (show,
    export, the training loader) stop naming shard, row and fault; verify reports both; inspect
    and pack read sizes only and go on."""
    import numpy as np

    from tests.helpers.shards import rewrite_shard
    from train.loader import PackedLoader
    from train.pack_plan import PackSettings

    data = Path(shutil.copytree(clean, tmp_path / "data"))
    rows = {}

    def damage(samples):
        samples[0].loss_mask = samples[0].loss_mask[:-1].copy()
        rows["image"] = next(j for j, sample in enumerate(samples) if j and sample.num_patches)
        samples[rows["image"]].pixel_patches = np.ascontiguousarray(samples[rows["image"]].pixel_patches[:-1])

    assert rewrite_shard(data, 0, damage) == DAMAGED_SHARD
    expected = {0: f"{DAMAGED_SHARD} row 0: [loss_mask_length] loss_mask has ",
                rows["image"]: f"{DAMAGED_SHARD} row {rows['image']}: [pixel_patches_length] pixel_patches has "}
    for argv, row in ((["show", data, "--index", "0"], 0), (["show", data, "--index", rows["image"]], rows["image"]),
                      (["export", data, "--out", tmp_path / "tars"], 0)):
        assert vlmpack([str(a) for a in argv]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and f"{data}/{expected[row]}" in err, err
    assert vlmpack(["verify", str(data)]) == 1
    out, _ = capsys.readouterr()
    assert all(f"FAULT {text}" in out for text in expected.values()), out
    for argv in (["inspect", data], ["pack", data, "--seq-len", str(SEQ_LEN)]):
        assert vlmpack([str(a) for a in argv]) == 0
        capsys.readouterr()
    dataset = PackedLoader([str(data)], PackSettings(seq_len=SEQ_LEN, global_batch_packs=1)).dataset()
    with pytest.raises(ShardFault, match=r"row \d+: \[(loss_mask|pixel_patches)_length\]"):
        for k in range(len(dataset)):
            dataset[k]


def test_save_images_of_a_grid_its_patches_cannot_have_names_the_sample_and_the_fix(clean, tmp_path, capsys):
    """A shard rewritten consistently but with one image's grid t x h x w given as 2 x h x w/2 (the
    same number of patches, so every size agrees): `show --save-images` stops with one line
    naming the sample, the grid and `vlmpack verify`, not a bare ValueError."""
    from tests.helpers.shards import rewrite_shard

    data = Path(shutil.copytree(clean, tmp_path / "data"))
    rows = {}

    def damage(samples):
        j = next(j for j, sample in enumerate(samples) if len(sample.image_grid_thw))
        t, h, w = samples[j].image_grid_thw[0]
        samples[j].image_grid_thw[0] = (2, h, w // 2) if w % 2 == 0 else (2, h // 2, w)
        rows["image"] = j

    assert rewrite_shard(data, 0, damage) == DAMAGED_SHARD
    assert vlmpack(["show", str(data), "--index", str(rows["image"]), "--save-images", str(tmp_path / "png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: sample {rows['image']} of {data}: grid 2x" in err, err
    assert err.rstrip().endswith(f"the shard is damaged; `vlmpack verify {data}` lists every such row"), err


TAR_EXPECTED = {
    "flipped_byte": rf"{DAMAGED_TAR}: sha256 [0-9a-f]+ does not match index\.json",
    "truncated": rf"{DAMAGED_TAR}: 30000 bytes, index\.json says \d+ \(truncated",
    "missing": rf"{DAMAGED_TAR}: listed in index\.json but missing",
    "index_not_json": r"index\.json: not valid JSON",
    "index_other_version": r"index\.json: format version 99, this vlmpack reads 1",
    "leftover_tmp": r"leftover vlmpack-000003\.tar\.tmp from an interrupted write",
    "index_version_a_string": r"index\.json: format_version '1' is not an integer: index\.json is damaged",
    "index_tars_null": r"index\.json: `tars` must be a list, got NoneType: index\.json is damaged",
    "index_manifest_a_string": r"index\.json: `manifest` must be an object, got str: index\.json is damaged",
    "index_rejects_null": r"index\.json: `rejects` must be an object, got NoneType: index\.json is damaged",
    "index_offsets_not_counts": r"index\.json: tar entry 0 \(vlmpack-000000\.tar\) has missing or invalid "
                                r"sample_offsets \(not a list of integers\)",
    "index_samples_a_string": r"index\.json: `samples` '\d+' is not an integer: index\.json is damaged",
    "index_without_tars": r"index\.json: `tars` must be a list, and it is missing: index\.json is damaged",
    "index_is_fifo": r"index\.json is a FIFO \(named pipe\), not a regular file",
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
    (["export", "{d}", "--out", "{d}/tars"], "--out {d}/tars lies inside the input directory {d}: choose a directory outside it"),
    (["export", "{d}", "--out", "{t}/o", "--format", "parquet"], "argument --format: invalid choice: 'parquet'"),
    (["export", "{d}", "--out", "{t}/o", "--samples-per-tar", "0"], "--samples-per-tar must be at least 1, got 0"),
    (["export", "{d}", "--out", "{t}/o", "--samples-per-tar", "few"], "argument --samples-per-tar: invalid int value: 'few'"),
    (["export", "{d}", "--out", "{t}/o", "--max-tar-bytes", "lots"], "argument --max-tar-bytes: 'lots' is not a size"),
    (["export", "{d}", "--out", "{t}/o", "--max-tar-bytes", "0"], "--max-tar-bytes must be positive, got 0"),
    (["export", "{d}", "--out", "{t}/o", "--max-tar-bytes", "-1G"], "argument --max-tar-bytes: '-1G' is not a size"),
    (["import", "{x}"], "the following arguments are required: --out"),
    (["import", "{t}/missing", "--out", "{t}/o"], "{t}/missing: no such directory: pass the directory written by `vlmpack export`"),
    (["import", "{f}", "--out", "{t}/o"], "{f} is a file, not a directory"),
    (["import", "{d}", "--out", "{t}/o"], "{d}: no index.json"),
    (["import", "{x}", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["import", "{x}", "--out", "{x}"], "--out {x} is the input directory"),
    (["import", "{x}", "--out", "{x}/shards"], "--out {x}/shards lies inside the input directory {x}"),
    (["pack", "{t}/missing", "--seq-len", "4096"], "{t}/missing: no such directory: pass the shard directory"),
    (["pack", "{f}", "--seq-len", "4096"], "{f} is a file, not a directory: pass the shard directory"),
    # paths no command can use: empty, a name over 255 bytes ({n}), a link leading back to itself ({l})
    (["verify", ""], "the shard directory is given as an empty string"),
    (["fetch", "{d}", ""], "the destination is given as an empty string"),
    (["inspect", "{d}", "--plots", ""], "--plots is given as an empty string"),
    (["verify", "{t}/{n}"], "file name too long: "),
    (["export", "{d}", "--out", "{t}/{n}"], "a name in a path may have at most 255 bytes"),
    (["pack", "{d}", "--seq-len", "4096", "--out", "{t}/{n}"], "file name too long: "),
    (["show", "{d}", "--save-images", "{t}/{n}"], "file name too long: "),
    (["export", "{d}", "--out", "{l}"], "symbolic link loop: "),
    (["inspect", "{d}", "--plots", "{l}"], "symbolic link loop: "),
    (["fetch", "{l}", "{t}/copy"], "symbolic link loop: "),
    # the viewers' outputs never land among the shards
    (["inspect", "{d}", "--plots", "{d}/charts"], "--plots {d}/charts lies inside the input directory {d}"),
    (["show", "{d}", "--save-images", "{d}/images"], "--save-images {d}/images lies inside the input directory {d}"),
    (["pack", "{d}", "--seq-len", "4096", "--out", "{d}/plan"], "--out {d}/plan lies inside the input directory {d}"),
    (["fetch", "{d}", "{d}/copy"], "the destination {d}/copy lies inside the input directory {d}"),
    (["train", "--arch", "tiny", "--data", "{d}", "--out", "{d}/run"],
     "--out {d}/run lies inside the input directory {d}"),
    (["train", "--arch", "tiny", "--data", "{d}:0.5", "--out", "{t}/run", "--export-hf", "{d}/hf"],
     "--export-hf {d}/hf lies inside the input directory {d}"),
    (["pack", "{d}", "--seq-len", "4096", "--out", "{g}"], "--out {g} is a link to {t}/nothing, which does not exist"),
    # a local path written as a file:// URL: named with the path to give instead, by every command
    (["inspect", "file://{d}"], "file://{d}: give a local directory as itself ({d}), without file://"),
    (["show", "file://{d}"], "file://{d}: give a local directory as itself ({d}), without file://"),
    (["verify", "file://{d}"], "the shard directory 'file://{d}': give a local path as itself ({d}), without file://"),
    (["pack", "file://{d}", "--seq-len", "4096"], "give a local directory as itself ({d}), without file://"),
    (["export", "{d}", "--out", "file://{t}/o"], "--out 'file://{t}/o': give a local path as itself ({t}/o)"),
    (["train", "--arch", "tiny", "--data", "file://{d}", "--out", "{t}/run"],
     "--data 'file://{d}': give a local path as itself ({d}), without file://"),
    (["preprocess", "file://{t}/rows.jsonl", "--out", "{t}/o"],
     "an input 'file://{t}/rows.jsonl': give a local path as itself ({t}/rows.jsonl), without file://"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line_and_exit_2(clean, clean_export, tmp_path, capsys, argv, message):
    scratch = tmp_path / "t"
    scratch.mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(scratch / "nothing")
    paths = {"d": clean, "x": clean_export, "f": tmp_path / "a-file", "t": scratch, "n": "x" * 300,
             "l": tmp_path / "loop", "g": tmp_path / "dangling"}
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


def test_a_shard_or_rejects_file_this_user_may_not_read_is_named_so(tmp_path, capsys, monkeypatch):
    """A shard this user may not read (chmod 000; where the tests run as root, which reads it
    anyway, the refusal injected) is `unreadable_shard` with the permissions to fix, not a
    damaged file to restore. An unreadable rejects.jsonl is a `verify` fault (exit 1) after
    every shard is checked, and `inspect` shows the directory without its reject examples."""
    import shards_schema.inspect as inspect_module
    import shards_schema.reader as reader_module
    import shards_schema.verify as verify_module

    rows = example_rows(8, seed=3, size_range=(32, 64))
    lines = [json.dumps(row) for row in rows] + ["{not json"]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    data = tmp_path / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "chats.jsonl")], out=str(data), workers=1,
                                    rows_per_shard=4, sample=SampleOptions(max_seq_len=SEQ_LEN), progress=False))
    shard, rejects = data / "shard-000001.arrow", data / "rejects.jsonl"
    refuse_reads(monkeypatch, [shard, rejects], [verify_module, inspect_module])
    real_access = os.access
    if os.geteuid() == 0:  # the reader asks os.access first
        monkeypatch.setattr(reader_module.os, "access", lambda path, mode: str(path) != str(shard) and
                            real_access(path, mode))
    try:
        for command in ("inspect", "show"):
            assert vlmpack([command, str(data)]) == 2, command
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{shard}: [unreadable_shard] this user may not read it (permission " \
                "denied): fix its permissions and check the directory" in err, (command, err)
        assert vlmpack(["verify", str(data)]) == 1
        out = capsys.readouterr().out
        assert "[unreadable_shard] this user may not read it (permission denied): fix its permissions" in out, out
        assert "[unreadable_rejects] rejects.jsonl cannot be read (Permission denied): its rejected rows cannot be " \
            "checked; fix its permissions" in out, out
        shard.chmod(0o644)
        monkeypatch.setattr(reader_module.os, "access", real_access)
        assert vlmpack(["inspect", str(data)]) == 0
        assert "rejects" in capsys.readouterr().out
    finally:
        for path in (shard, rejects):
            path.chmod(0o644)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command_has_help(command):
    module, attr = COMMANDS[command][0].split(":")
    parser = argparse.ArgumentParser(prog=command)
    getattr(importlib.import_module(module), attr).add_arguments(parser)
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{command}: {action.option_strings or action.dest} has no help"
