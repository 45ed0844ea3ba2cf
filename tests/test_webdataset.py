"""WebDataset interop: export to tars the `webdataset` package reads, import back byte for byte,
deterministic bytes, random access by member offsets, clear errors on damaged exports, CLI."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import open_shards
from shards_schema.errors import UserError
from shards_schema.fetch import fetch
from shards_schema.manifest import ShardFormatError, load_manifest
from shards_schema.outdir import exclusive_output_dir, user_entries
from shards_schema.webdataset import (
    INDEX_NAME,
    MEMBER_NAMES,
    WebDatasetFormatError,
    WebDatasetShards,
    export_webdataset,
    import_webdataset,
    iter_webdataset_samples,
    sample_key,
)

ROWS = 20
SAMPLES_PER_TAR = 6  # not a divisor of the 8 rows per Arrow shard: tars straddle shard boundaries
ARRAYS = ("input_ids", "loss_mask", "position_ids", "image_grid_thw", "pixel_patches")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    rows = example_rows(ROWS, seed=11, size_range=(32, 160), include_bad_rows=True)
    out = data / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(data / "chats.jsonl", rows))], out=str(out), workers=1, rows_per_shard=8, progress=False))
    return out


@pytest.fixture(scope="module")
def source(shard_dir):
    shards = open_shards(shard_dir)
    return [shards[i] for i in range(len(shards))]


@pytest.fixture(scope="module")
def exported(shard_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tars"
    return out, export_webdataset(shard_dir, out, samples_per_tar=SAMPLES_PER_TAR)


def assert_same_sample(got: dict, want: dict, where: str) -> None:
    assert got["sample_uid"] == want["sample_uid"] and got["source"] == want["source"], where
    for name in ARRAYS:
        a, b = got[name], want[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {name}"
        assert a.tobytes() == b.tobytes(), f"{where}: {name}"


def test_source_covers_text_only_and_multi_image(source, shard_dir):
    images = [s["image_grid_thw"].shape[0] for s in source]
    assert min(images) == 0 and max(images) >= 2
    assert load_manifest(shard_dir)["accounting"]["rows_rejected"] > 0


def test_index_and_tar_layout(exported, shard_dir, source):
    out, index = exported
    assert json.loads((out / INDEX_NAME).read_text()) == index
    names = [t["file"] for t in index["tars"]]
    assert names == [f"vlmpack-{k:06d}.tar" for k in range(len(names))]
    assert sorted(p.name for p in out.glob("*.tar")) == names and not list(out.glob("*.tmp"))
    assert [t["samples"] for t in index["tars"]] == [6, 6, 6, 2] and index["samples"] == len(source)
    assert index["manifest"] == load_manifest(shard_dir)
    assert (out / "rejects.jsonl").read_bytes() == (shard_dir / "rejects.jsonl").read_bytes()
    assert index["url_pattern"] == "vlmpack-{000000..000003}.tar"

    first = 0
    for entry in index["tars"]:
        path = out / entry["file"]
        assert entry["first_index"] == first
        assert entry["bytes"] == path.stat().st_size and entry["bytes"] % tarfile.RECORDSIZE == 0
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        with tarfile.open(path) as archive:
            members = archive.getmembers()
        keys = [sample_key(first + j) for j in range(entry["samples"])]
        assert [m.name for m in members] == [f"{key}.{name}" for key in keys for name in MEMBER_NAMES]
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) for m in members} == {(0, 0, 0, "", "", 0o644, tarfile.REGTYPE)}
        # the recorded offsets are the header offsets of each sample's first member
        assert entry["sample_offsets"] == [m.offset for m in members[:: len(MEMBER_NAMES)]]
        assert entry["end_offset"] == members[-1].offset_data + -(-members[-1].size // 512) * 512
        first += entry["samples"]
    assert "." not in sample_key(12) and sample_key(12) == "s000000012"


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_a_shard_command_on_an_export_directory_points_to_import(exported, tmp_path, capsys, command):
    from shards_schema.cli import main

    exported = exported[0]
    argv = [command, str(exported)] + (["--out", str(tmp_path / "again")] if command == "export" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{exported}: no manifest.json but an index.json: a `vlmpack export` directory? " \
        f"`vlmpack import {exported} --out DIR` makes shards of it" in err, err


def test_npy_members_are_numpy_save_bytes(exported, source):
    out, _ = exported
    with tarfile.open(out / "vlmpack-000000.tar") as archive:
        for j in range(SAMPLES_PER_TAR):
            for name in ARRAYS:
                buf = io.BytesIO()
                np.save(buf, source[j][name])
                assert archive.extractfile(f"{sample_key(j)}.{name}.npy").read() == buf.getvalue()
            meta = json.loads(archive.extractfile(f"{sample_key(j)}.meta.json").read())
            assert meta["sample_uid"] == source[j]["sample_uid"] and meta["index"] == j
            assert meta["num_target_tokens"] == int(source[j]["loss_mask"].sum())


def test_webdataset_package_decodes_the_tars(exported, source):
    webdataset = pytest.importorskip("webdataset")
    out, index = exported
    for urls in (WebDatasetShards(out).tar_paths(), str(out / index["url_pattern"])):
        decoded = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
        assert len(decoded) == len(source)
        for i, (sample, want) in enumerate(zip(decoded, source)):
            assert sample["__key__"] == sample_key(i)
            got = {name: sample[f"{name}.npy"] for name in ARRAYS}
            got |= {"sample_uid": sample["meta.json"]["sample_uid"], "source": sample["meta.json"]["source"]}
            assert_same_sample(got, want, f"webdataset sample {i}")


def test_iteration_and_random_access_match_open_shards(exported, source):
    out, _ = exported
    iterated = list(iter_webdataset_samples(out, verify=True))
    assert len(iterated) == len(source)
    dataset = pickle.loads(pickle.dumps(WebDatasetShards(out)))  # DataLoader workers get it by pickling
    assert len(dataset) == len(source) and dataset.manifest["totals"]["rows"] == len(source)
    for i, want in enumerate(source):
        assert set(iterated[i]) == set(want)
        assert_same_sample(iterated[i], want, f"iterated sample {i}")
        assert_same_sample(dataset[i], want, f"random access sample {i}")
    assert_same_sample(dataset[-1], source[-1], "sample -1")
    with pytest.raises(IndexError):
        dataset[len(source)]
    dataset.close()
    assert_same_sample(dataset[3], source[3], "sample 3 after close")


def test_round_trip_is_byte_identical(exported, shard_dir, source, tmp_path):
    out, _ = exported
    back = tmp_path / "back"
    manifest = import_webdataset(out, back)
    original = load_manifest(shard_dir)
    assert manifest == original == load_manifest(back)  # profile, settings, accounting, totals and shard sha256
    for entry in original["shards"]:
        assert (back / entry["file"]).read_bytes() == (shard_dir / entry["file"]).read_bytes()
    assert (back / "rejects.jsonl").read_bytes() == (shard_dir / "rejects.jsonl").read_bytes()
    shards = open_shards(back)
    for i, want in enumerate(source):
        assert_same_sample(shards[i], want, f"round-trip sample {i}")


def test_a_tar_the_index_does_not_list_is_named_on_import(exported, tmp_path, capsys):
    tardir, _ = exported
    copy = tmp_path / "tars"
    shutil.copytree(tardir, copy)
    first = sorted(copy.glob("*.tar"))[0]
    shutil.copy(first, copy / "vlmpack-000099.tar")
    import_webdataset(copy, tmp_path / "back")
    err = capsys.readouterr().err
    assert "1 tar file(s)" in err and "vlmpack-000099.tar" in err and "not imported" in err, err
    import_webdataset(tardir, tmp_path / "back2")
    assert "tar file(s)" not in capsys.readouterr().err


def test_export_is_deterministic(exported, shard_dir, tmp_path):
    out, _ = exported
    again = tmp_path / "again"
    export_webdataset(shard_dir, again, samples_per_tar=SAMPLES_PER_TAR)
    names = sorted(user_entries(out))
    assert names == sorted(user_entries(again)) and "index.json" in names
    for name in names:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_max_tar_bytes_bounds_tars(shard_dir, source, tmp_path):
    limit = 1_200_000
    index = export_webdataset(shard_dir, tmp_path / "small", max_tar_bytes=limit)
    assert len(index["tars"]) > 2
    assert all(t["bytes"] <= limit or t["samples"] == 1 for t in index["tars"])
    assert sum(t["samples"] for t in index["tars"]) == len(source)
    one_each = export_webdataset(shard_dir, tmp_path / "tiny", max_tar_bytes=1)  # every sample is "too big": one per tar
    assert [t["samples"] for t in one_each["tars"]] == [1] * len(source)
    assert_same_sample(WebDatasetShards(tmp_path / "tiny")[7], source[7], "one-per-tar sample 7")


def test_sample_stats_from_tar_headers_match_the_arrow_counts(exported, shard_dir, tmp_path):
    out, _ = exported
    want = open_shards(shard_dir).sample_stats()
    dataset = WebDatasetShards(out)
    stats = dataset.sample_stats()
    assert sorted(stats) == sorted(set(want) - {"num_target_tokens"})  # num_target_tokens lives in meta.json only
    for name, values in stats.items():
        assert values.dtype == np.int64 and np.array_equal(values, want[name]), name
    assert want["num_images"].max() >= 2 and want["num_patches"].min() == 0  # multi-image and text-only samples
    stats["num_tokens"][0] = -1  # callers get copies of the cached arrays
    assert np.array_equal(dataset.sample_stats()["num_tokens"], want["num_tokens"])
    assert dataset.directory == out
    one_each = tmp_path / "one_each"  # one sample per tar: a walk per tar, same global order
    export_webdataset(shard_dir, one_each, samples_per_tar=1)
    for name, values in WebDatasetShards(one_each).sample_stats().items():
        assert np.array_equal(values, want[name]), name


def test_sample_stats_refuse_a_tar_that_does_not_match_the_index(exported, tmp_path):
    tardir = _copy(exported, tmp_path)
    tar = tardir / "vlmpack-000001.tar"
    data = bytearray(tar.read_bytes())
    start = json.loads((tardir / INDEX_NAME).read_text())["tars"][1]["sample_offsets"][2]
    data[start + 1] = ord("9")  # the name of sample s000000008's first member
    tar.write_bytes(bytes(data))
    with pytest.raises(WebDatasetFormatError, match=rf"vlmpack-000001\.tar: sample s000000008 \(byte {start}\): expected member image_grid_thw\.npy"):
        WebDatasetShards(tardir).sample_stats()
    tar.write_bytes(bytes(data[:start]))
    with pytest.raises(WebDatasetFormatError, match=rf"vlmpack-000001\.tar: {start} bytes, index\.json says"):
        WebDatasetShards(tardir).sample_stats()


# ---------------------------------------------------------------------------- damaged exports


def _copy(exported, tmp_path) -> Path:
    return Path(shutil.copytree(exported[0], tmp_path / "copy"))


def _rewrite_tar(tardir: Path, k: int, transform) -> None:
    """Rebuild tar k with `transform(name, bytes) -> (name, bytes) | None`, keeping index.json consistent."""
    index = json.loads((tardir / INDEX_NAME).read_text())
    entry = index["tars"][k]
    path = tardir / entry["file"]
    with tarfile.open(path) as archive:
        members = [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for item in members:
            item = transform(*item)
            if item is not None:
                info = tarfile.TarInfo(item[0])
                info.size = len(item[1])
                archive.addfile(info, io.BytesIO(item[1]))
    entry["bytes"] = path.stat().st_size
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (tardir / INDEX_NAME).write_text(json.dumps(index))


OFFSET_EDITS = {
    "out_of_order": lambda e, rng: e["sample_offsets"].__setitem__(3, e["sample_offsets"][1]),
    "small": lambda e, rng: e["sample_offsets"].__setitem__(rng.randrange(1, e["samples"]), 512 * rng.randrange(0, 3)),
    "not_a_block": lambda e, rng: e["sample_offsets"].__setitem__(rng.randrange(1, e["samples"]),
                                                                 e["sample_offsets"][-1] + rng.randrange(1, 512)),
    "first_not_0": lambda e, rng: e["sample_offsets"].__setitem__(0, 512),
    "end_before_last": lambda e, rng: e.__setitem__("end_offset", e["sample_offsets"][-1]),
    "end_past_the_tar": lambda e, rng: e.__setitem__("end_offset", e["bytes"] + 512 * rng.randrange(1, 4)),
}


@pytest.mark.parametrize("edit", sorted(OFFSET_EDITS))
def test_index_offsets_that_do_not_frame_the_tar_are_refused_on_open(exported, tmp_path, edit):
    """Random access reads a sample from its offset to the next one's: an index.json whose
    offsets go backwards, off a block boundary or past the tar is refused when the export is
    opened (import, training), naming the tar, never an OSError from a negative read."""
    rng = random.Random(edit)
    tardir = _copy(exported, tmp_path)
    index = json.loads((tardir / INDEX_NAME).read_text())
    entry = rng.choice([t for t in index["tars"] if t["samples"] >= 4])
    OFFSET_EDITS[edit](entry, rng)
    (tardir / INDEX_NAME).write_text(json.dumps(index))
    message = rf"{INDEX_NAME}: entry for {entry['file']}: sample_offsets and end_offset are not increasing"
    with pytest.raises(WebDatasetFormatError, match=message):
        WebDatasetShards(tardir)
    with pytest.raises(WebDatasetFormatError, match=message):
        import_webdataset(tardir, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_truncated_tar_is_refused_by_name(exported, tmp_path):
    tardir = _copy(exported, tmp_path)
    tar = tardir / "vlmpack-000001.tar"
    tar.write_bytes(tar.read_bytes()[:300_000])
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000001\.tar: 300000 bytes, index\.json says"):
        import_webdataset(tardir, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000001\.tar: not a readable tar .*truncated"):
        list(iter_webdataset_samples(tardir))
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000001\.tar: sample s000000011: the tar has 300000 bytes"):
        WebDatasetShards(tardir)[11]


def test_checksum_mismatch_is_refused_by_name(exported, tmp_path):
    tardir = _copy(exported, tmp_path)
    tar = tardir / "vlmpack-000002.tar"
    data = bytearray(tar.read_bytes())
    data[100_000] ^= 0xFF  # same size, different bytes
    tar.write_bytes(bytes(data))
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000002\.tar: sha256 .* does not match index\.json"):
        import_webdataset(tardir, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_missing_member_and_wrong_dtype_name_tar_key_member(exported, tmp_path):
    tardir = _copy(exported, tmp_path)
    _rewrite_tar(tardir, 0, lambda name, data: None if name == "s000000003.loss_mask.npy" else (name, data))
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000000\.tar: sample s000000003: missing member\(s\) loss_mask\.npy"):
        import_webdataset(tardir, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("*.tmp"))

    def widen(name, data):
        if name == "s000000008.input_ids.npy":
            buf = io.BytesIO()
            np.save(buf, np.load(io.BytesIO(data)).astype(np.int64))
            data = buf.getvalue()
        return name, data

    _rewrite_tar(tardir, 1, widen)
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000001\.tar: sample s000000008\.input_ids\.npy: dtype <i8 \(int64\), the contract says <i4"):
        list(WebDatasetShards(tardir).iter_tar(1))

    _rewrite_tar(tardir, 2, lambda name, data: (name.replace("s000000013", "s000000099"), data))
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000002\.tar: member s000000099\.\S+: expected sample s000000013"):
        list(WebDatasetShards(tardir).iter_tar(2))


def test_missing_index_or_tar_and_busy_out_dir(exported, shard_dir, tmp_path):
    tardir = _copy(exported, tmp_path)
    (tardir / "vlmpack-000003.tar").unlink()
    with pytest.raises(WebDatasetFormatError, match=r"vlmpack-000003\.tar: listed in index\.json but missing"):
        import_webdataset(tardir, tmp_path / "out")
    (tardir / INDEX_NAME).unlink()
    with pytest.raises(WebDatasetFormatError, match=r"no index\.json \(an export that has not finished"):
        WebDatasetShards(tardir)
    with pytest.raises(UserError, match=r"holds the output of an unfinished \(no index\.json\) `vlmpack export`: pass --overwrite"):
        export_webdataset(shard_dir, tardir)
    export_webdataset(shard_dir, tardir, samples_per_tar=100, overwrite=True)  # replaces the stale tars
    assert user_entries(tardir) == ["index.json", "rejects.jsonl", "vlmpack-000000.tar"]
    with pytest.raises(UserError, match=r"holds the output of a finished `vlmpack export`: pass --overwrite"):
        export_webdataset(shard_dir, tardir)


# ---------------------------------------------------------------------------- corruption stops at the first command


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_shard_with_a_flipped_byte_does_not_export(shard_dir, tmp_path):
    source = Path(shutil.copytree(shard_dir, tmp_path / "source"))
    second = load_manifest(source)["shards"][1]["file"]
    _flip_byte(source / second, (source / second).stat().st_size // 2)  # inside the pixel values: the Arrow file still reads
    assert open_shards(source)[10]["input_ids"].size > 0
    done = _cli("export", source, "--out", tmp_path / "tars", "--samples-per-tar", 3)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
    assert f"{source / second}: [sha256_mismatch] sha256 " in done.stderr and "does not match manifest.json" in done.stderr
    assert not (tmp_path / "tars").exists()  # the first shard's tars were written, then removed, and the --out it made
    with pytest.raises(ShardFormatError, match=rf"{second}: \[size_mismatch\] [\d,]+ bytes on disk, the manifest says [\d,]+ \(truncated"):
        (source / second).write_bytes((source / second).read_bytes()[:-100])
        export_webdataset(source, tmp_path / "tars")
    (source / second).unlink()
    with pytest.raises(ShardFormatError, match=rf"{second}: \[missing_shard\] listed in manifest\.json but missing"):
        export_webdataset(source, tmp_path / "tars")


def test_a_changed_sample_with_a_matching_tar_checksum_does_not_import(exported, shard_dir, tmp_path):
    tardir = _copy(exported, tmp_path)
    index = json.loads((tardir / INDEX_NAME).read_text())
    first = index["manifest"]["shards"][0]["file"]
    big = max(range(SAMPLES_PER_TAR), key=lambda j: WebDatasetShards(tardir)[j]["pixel_patches"].size)

    def flip_a_pixel(name, data):
        if name == f"{sample_key(big)}.pixel_patches.npy":
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        return name, data

    _rewrite_tar(tardir, 0, flip_a_pixel)  # tar bytes and sha256 in index.json stay consistent
    WebDatasetShards(tardir).verify()
    out = tmp_path / "out"
    with pytest.raises(WebDatasetFormatError, match=rf"{first}: sha256 [0-9a-f]+, the exported shard's entry in .*index\.json says"):
        import_webdataset(tardir, out)
    assert not out.exists()  # nothing partial, and no --out left made


@pytest.mark.parametrize(
    "member, change, message",
    [
        ("loss_mask.npy", lambda a: np.where(a == 1, 2, a).astype(a.dtype), r"loss_mask\.npy: value 2, the contract allows 0 and 1"),
        ("image_grid_thw.npy", lambda a: np.zeros_like(a), r"image_grid_thw\.npy: grid \[\[0, 0, 0\].* below 1"),
        ("meta.json", lambda m: m | {"index": 0}, r"meta\.json: index 0, the sample's arrays and place say 9"),
        ("meta.json", lambda m: m | {"num_tokens": m["num_tokens"] + 1}, r"meta\.json: num_tokens \d+, the sample's arrays and place say"),
        ("meta.json", lambda m: m | {"num_images": m["num_images"] + 1}, r"meta\.json: num_images \d+, the sample's arrays and place say"),
    ],
)
def test_import_checks_each_sample_and_names_tar_and_sample(exported, tmp_path, member, change, message):
    tardir = _copy(exported, tmp_path)
    key = sample_key(9)  # the image sample of tar 1 checked below

    def edit(name, data):
        if name == f"{key}.{member}":
            if member == "meta.json":
                data = json.dumps(change(json.loads(data))).encode()
            else:
                buf = io.BytesIO()
                np.save(buf, change(np.load(io.BytesIO(data))))
                data = buf.getvalue()
        return name, data

    assert WebDatasetShards(tardir)[9]["image_grid_thw"].shape[0] >= 1 and WebDatasetShards(tardir)[9]["loss_mask"].max() == 1
    _rewrite_tar(tardir, 1, edit)
    out = tmp_path / "out"
    with pytest.raises(WebDatasetFormatError, match=rf"vlmpack-000001\.tar: sample {key}\.{message}"):
        import_webdataset(tardir, out)
    assert not out.exists()  # the first shard was written, then removed, and the --out it made
    done = _cli("import", tardir, "--out", out)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and f"vlmpack-000001.tar: sample {key}." in done.stderr


def test_out_dir_with_other_files_is_refused_even_with_overwrite(exported, shard_dir, tmp_path):
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "vlmpack-000000.tar").write_bytes(b"old")
    for overwrite in (False, True):
        with pytest.raises(UserError, match=r"holds files that `vlmpack export` did not write \(notes\.txt\): choose an empty"):
            export_webdataset(shard_dir, out, overwrite=overwrite)
        with pytest.raises(UserError, match=r"holds files that `vlmpack import` did not write \(notes\.txt, vlmpack-000000\.tar\)"):
            import_webdataset(exported[0], out, overwrite=overwrite)
    assert (out / "notes.txt").read_text() == "mine" and (out / "vlmpack-000000.tar").read_bytes() == b"old"
    listings = {d: sorted(p.name for p in d.iterdir()) for d in (shard_dir, exported[0])}
    with pytest.raises(UserError, match=r"is the input directory"):
        export_webdataset(shard_dir, shard_dir, overwrite=True)
    with pytest.raises(UserError, match=r"is the input directory"):
        import_webdataset(exported[0], exported[0], overwrite=True)
    assert listings == {d: sorted(p.name for p in d.iterdir()) for d in listings}


def test_a_second_export_into_a_held_out_dir_is_refused(shard_dir, tmp_path):
    out = tmp_path / "held"
    with exclusive_output_dir(out, "export"):
        done = _cli("export", shard_dir, "--out", out)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "is in use by another job (vlmpack export, pid" in done.stderr


# ---------------------------------------------------------------------------- CLI and imports


def _cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "shards_schema.cli", *map(str, args)]


def _cli(*args):
    return subprocess.run(_cli_cmd(*args), capture_output=True, text=True, cwd=REPO_ROOT)


def test_cli_export_import_and_bad_input(shard_dir, tmp_path):
    tardir, back = tmp_path / "tars", tmp_path / "back"
    done = _cli("export", shard_dir, "--format", "webdataset", "--out", tardir, "--samples-per-tar", 5, "--max-tar-bytes", "64M")
    assert done.returncode == 0, done.stderr
    assert "exported 20 samples into 4 tars" in done.stdout
    done = _cli("import", tardir, "--out", back)
    assert done.returncode == 0, done.stderr
    assert load_manifest(back) == load_manifest(shard_dir)

    (tmp_path / "empty").mkdir()
    bad = _cli("export", tmp_path / "empty", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr
    bad = _cli("import", shard_dir, "--out", tmp_path / "y")
    assert bad.returncode == 2 and "no index.json" in bad.stderr
    bad = _cli("export", shard_dir, "--out", tmp_path / "z", "--samples-per-tar", 0)
    assert bad.returncode == 2 and "--samples-per-tar must be at least 1" in bad.stderr
    bad = _cli("import", tardir, "--out", back)
    assert bad.returncode == 2 and "holds the output of a finished `vlmpack import`: pass --overwrite" in bad.stderr
    done = _cli("import", tardir, "--out", back, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert load_manifest(back) == load_manifest(shard_dir)


def test_overwrite_never_deletes_files_of_our_names_that_another_command_or_the_user_wrote(exported, shard_dir,
                                                                                            tmp_path):
    """Files named as `import` and `export` name theirs are replaced only where the directory's
    lock file records that command as its last writer: a fetched shard directory, a user's own
    .arrow files and a lone index.json stay, --overwrite or not."""
    shards = tmp_path / "fetched"  # a shard directory of the files import writes; its lock file records fetch
    fetch(str(shard_dir), shards, progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my-data.arrow").write_bytes(b"mine")
    index_only = tmp_path / "index_only"
    index_only.mkdir()
    (index_only / INDEX_NAME).write_text("{}")
    before = {d: {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} for d in (shards, mine, index_only)}
    for overwrite in (False, True):
        for out in (shards, mine):
            with pytest.raises(UserError, match=r"is not empty \(.*\) and is not the output of `vlmpack import`: "
                                                 r"choose an empty or new directory"):
                import_webdataset(exported[0], out, overwrite=overwrite)
        with pytest.raises(UserError, match=r"is not empty \(index\.json\) and is not the output of `vlmpack export`"):
            export_webdataset(shard_dir, index_only, overwrite=overwrite)
    assert before == {d: {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} for d in before}
    bad = _cli("import", exported[0], "--out", shards, "--overwrite")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not the output of `vlmpack import`" in bad.stderr


def test_import_says_which_tars_the_index_does_not_list(exported, tmp_path, capsys):
    """A tar beside the export that index.json does not list holds samples the import does not
    read: said in a warning naming it, the listed samples imported."""
    tardir = _copy(exported, tmp_path)
    (tardir / "vlmpack-000099.tar").write_bytes(b"\0" * 1024)
    manifest = import_webdataset(tardir, tmp_path / "back")
    assert manifest["totals"]["rows"] == exported[1]["samples"]
    assert capsys.readouterr().err == (f"vlmpack import: warning: {tardir} holds 1 tar file(s) that index.json does not "
                                       "list, not imported: vlmpack-000099.tar\n")


def test_export_and_import_count_their_samples_on_a_bar_when_asked(shard_dir, tmp_path, capsys):
    """`progress`: a bar of the samples written, ending at every sample of the directory (the
    commands ask for it on a terminal only)."""
    rows = load_manifest(shard_dir)["totals"]["rows"]
    export_webdataset(shard_dir, tmp_path / "tars", samples_per_tar=SAMPLES_PER_TAR, progress=True)
    assert re.search(rf"export: 100%.*{rows}/{rows}", capsys.readouterr().err.replace("\r", "\n"))
    import_webdataset(tmp_path / "tars", tmp_path / "back", progress=True)
    assert re.search(rf"import: 100%.*{rows}/{rows}", capsys.readouterr().err.replace("\r", "\n"))
    export_webdataset(shard_dir, tmp_path / "quiet", samples_per_tar=SAMPLES_PER_TAR)
    assert capsys.readouterr().err == ""


def test_import_killed_at_random_moments_then_rerun_is_byte_identical(shard_dir, tmp_path):
    """kill -9 while the shards are written: the re-run refuses the unfinished directory in one line
    unless told --overwrite, and then writes the source's bytes exactly."""
    small = tmp_path / "small"  # one row per shard: many steps to interrupt
    run_preprocess(PreprocessConfig(inputs=[str(next(shard_dir.parent.glob("*.jsonl")))], out=str(small), workers=1,
                                    rows_per_shard=1, progress=False))
    tardir = tmp_path / "tars"
    export_webdataset(small, tardir, samples_per_tar=SAMPLES_PER_TAR)
    expected = {entry["file"]: (small / entry["file"]).read_bytes() for entry in load_manifest(small)["shards"]}
    expected |= {name: (small / name).read_bytes() for name in ("rejects.jsonl", "manifest.json")}
    interrupted = 0
    for seed in range(4):
        out = tmp_path / f"back{seed}"
        proc = subprocess.Popen(_cli_cmd("import", tardir, "--out", out), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        after = random.Random(seed).randrange(len(expected) - 2)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not (out.is_dir() and len(list(out.glob("*.arrow"))) >= after):
            assert time.monotonic() < deadline, "import never wrote its shards"
            time.sleep(0.002)
        proc.kill()
        proc.wait()
        if (out / "manifest.json").exists():
            continue
        interrupted += 1
        if user_entries(out):
            again = _cli("import", tardir, "--out", out)
            assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
            assert "holds the output of an unfinished (no manifest.json) `vlmpack import`: pass --overwrite" in again.stderr
        done = _cli("import", tardir, "--out", out, "--overwrite")
        assert done.returncode == 0, done.stderr
        assert sorted(user_entries(out)) == sorted(expected), seed
        for name, data in expected.items():
            assert (out / name).read_bytes() == data, (seed, name)
    assert interrupted >= 2, "the kills all came too late to interrupt anything"


def test_module_imports_neither_preprocess_nor_torch():
    code = (
        "import sys, shards_schema.webdataset; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'preprocess', 'train', 'torch', 'PIL', 'webdataset'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
