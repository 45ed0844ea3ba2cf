"""`vlmpack verify` on real corruptions of a small real shard directory.

One directory is preprocessed per module; each test corrupts its own copy. Row-level faults
are written with ShardWriter and the manifest entry updated (sha256, bytes, stats, totals),
so only the row checks of the full mode can catch them, and `--quick` is shown to pass them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import ShardFormatError
from shards_schema.cli import main as cli_main
from shards_schema.verify import verify_shards
from tests.helpers.shards import manifest_of, rewrite_shard, write_manifest

REPO_ROOT = Path(__file__).resolve().parents[1]
ROWS = 20  # + 2 bad rows, 8 rows per unit -> 3 shards


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    data = write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl",
                       example_rows(ROWS, seed=11, size_range=(32, 160), include_bad_rows=True, video_rows=0.25))
    out = tmp_path_factory.mktemp("shards") / "out"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, rows_per_shard=8, progress=False))
    return out


@pytest.fixture
def shards(original, tmp_path) -> Path:
    return Path(shutil.copytree(original, tmp_path / "copy"))


def verify_cli(d: Path, *args: str, capsys) -> tuple[int, str]:
    rc = cli_main(["verify", str(d), *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def kinds(report) -> set[str]:
    return set(report.fault_counts)


def special(d: Path) -> dict:
    return manifest_of(d)["profile"]["special_tokens"]


def first_row(samples, with_images: bool) -> int:
    """The first row with (or without) images, and without videos."""
    return next(j for j, s in enumerate(samples) if (s.num_images > 0) == with_images and s.num_videos == 0)


def video_row(samples) -> int:
    return next(j for j, s in enumerate(samples) if s.num_videos > 0)


# --------------------------------------------------------------------------- clean


def test_clean_directory_passes_both_modes(shards, capsys):
    for args in ((), ("--quick",)):
        rc, out = verify_cli(shards, *args, capsys=capsys)
        assert rc == 0, out
        assert "OK" in out and "FAULT" not in out
    report = verify_shards(shards)
    assert report.ok and report.faults == [] and report.rows == manifest_of(shards)["totals"]["rows"]
    assert report.shards == 3
    rc, out = verify_cli(shards, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 0 and data["ok"] is True and data["mode"] == "full" and data["num_faults"] == 0


def test_subprocess_entry_point(shards):
    cmd = [sys.executable, "-m", "shards_schema.cli", "verify", str(shards)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout
    (shards / "shard-000001.arrow").unlink()
    done = subprocess.run(cmd + ["--quick"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "shard-000001.arrow" in done.stdout and "missing_shard" in done.stdout


# --------------------------------------------------------------------------- files and manifest


def test_truncated_shard_fails_in_both_modes(shards, capsys):
    path = shards / "shard-000000.arrow"
    path.write_bytes(path.read_bytes()[:-100])
    for args in ((), ("--quick",)):
        rc, out = verify_cli(shards, *args, capsys=capsys)
        assert rc == 1
        assert "shard-000000.arrow: [size_mismatch]" in out
        assert "shard-000000.arrow: [unreadable_shard]" in out and "footer" in out
    assert kinds(verify_shards(shards, quick=True)) == {"size_mismatch", "unreadable_shard"}


def _pixel_data_offset(path: Path) -> int:
    """File offset of the middle of the first batch's pixel values (not footer, not offsets)."""
    mm = pa.memory_map(str(path))
    base = mm.read_buffer(1).address
    mm.seek(0)
    buf = pa.ipc.open_file(mm).get_batch(0).column("pixel_patches").values.buffers()[1]
    assert buf.size > 1000
    return buf.address - base + buf.size // 2


def test_flipped_pixel_byte_full_catches_quick_does_not(shards, capsys):
    path = shards / "shard-000000.arrow"
    data = bytearray(path.read_bytes())
    data[_pixel_data_offset(path)] ^= 0xFF
    path.write_bytes(bytes(data))
    # the documented trade-off: --quick reads no pixel values and hashes nothing
    rc, out = verify_cli(shards, "--quick", capsys=capsys)
    assert rc == 0, out
    rc, out = verify_cli(shards, capsys=capsys)
    assert rc == 1 and "shard-000000.arrow: [sha256_mismatch]" in out
    assert kinds(verify_shards(shards)) == {"sha256_mismatch"}


def test_deleted_shard(shards, capsys):
    (shards / "shard-000002.arrow").unlink()
    for quick in (False, True):
        report = verify_shards(shards, quick=quick)
        assert kinds(report) == {"missing_shard"}
        assert report.faults[0].shard == "shard-000002.arrow"
    rc, _ = verify_cli(shards, "--quick", capsys=capsys)
    assert rc == 1


def test_edited_manifest_rows_tokens_accounting(shards):
    manifest = manifest_of(shards)
    manifest["shards"][0]["rows"] += 1  # totals now disagree too
    manifest["shards"][1]["tokens"] += 5
    manifest["totals"]["tokens"] += 5  # consistent totals: only the shard's own rows tell
    manifest["accounting"]["rows_read"] += 1
    write_manifest(shards, manifest)
    for quick in (False, True):
        report = verify_shards(shards, quick=quick)
        assert kinds(report) == {"row_count", "totals_mismatch", "shard_stats", "accounting_mismatch"}
        by_kind = {f.kind: f for f in report.faults}
        assert by_kind["row_count"].shard == "shard-000000.arrow"
        assert by_kind["shard_stats"].shard == "shard-000001.arrow" and "tokens" in by_kind["shard_stats"].message
        assert "totals.rows" in by_kind["totals_mismatch"].message


@pytest.mark.parametrize("field, value", [("rows", -5), ("rows", "21"), ("bytes", -1)])
def test_a_faulty_entry_names_its_field_and_its_file_is_not_called_unlisted(shards, field, value):
    manifest = manifest_of(shards)
    manifest["shards"][0][field] = value
    write_manifest(shards, manifest)
    found = kinds(verify_shards(shards, quick=True))
    assert "unlisted_shard" not in found and found, found


def test_schema_version_change_is_exit_2(shards, capsys):
    manifest = manifest_of(shards)
    manifest["schema_version"] = 99
    write_manifest(shards, manifest)
    rc, out = verify_cli(shards, capsys=capsys)
    assert rc == 2 and "schema version 99" in out
    rc, out = verify_cli(shards, "--json", capsys=capsys)
    assert rc == 2 and "schema version 99" in json.loads(out)["error"]
    with pytest.raises(ShardFormatError):
        verify_shards(shards, quick=True)
    (shards / "manifest.json").write_text("{not json")
    assert verify_cli(shards, capsys=capsys)[0] == 2
    (shards / "manifest.json").unlink()
    assert verify_cli(shards, "--quick", capsys=capsys)[0] == 2


def test_swapped_shards(shards):
    a, b = shards / "shard-000000.arrow", shards / "shard-000002.arrow"
    a.rename(shards / "swap.tmp")
    b.rename(a)
    (shards / "swap.tmp").rename(b)
    for quick in (False, True):
        found = kinds(verify_shards(shards, quick=quick))
        assert {"size_mismatch", "row_count", "shard_stats"} <= found
    # sizes differ, so the hash is not even needed; with equal sizes sha256 would differ (full mode)


def test_stray_arrow_and_leftover_tmp(shards):
    shutil.copyfile(shards / "shard-000000.arrow", shards / "shard-000099.arrow")
    (shards / "shard-000003.arrow.tmp").write_bytes(b"torn")
    shutil.copyfile(shards / "shard-000000.arrow", shards / "_parts" / "ignored.arrow")  # job internals: not checked
    report = verify_shards(shards, quick=True)
    assert kinds(report) == {"unlisted_shard", "leftover_tmp"}
    assert {f.shard for f in report.faults} == {"shard-000099.arrow", "shard-000003.arrow.tmp"}


def test_rejects_line_removed(shards):
    path = shards / "rejects.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 2
    path.write_text(lines[0])
    report = verify_shards(shards, quick=True)
    assert kinds(report) == {"rejects_mismatch"}
    assert "1 lines" in report.faults[0].message and "rows_rejected = 2" in report.faults[0].message
    path.write_text(lines[0] + "{broken\n")
    assert "does not parse" in verify_shards(shards, quick=True).faults[0].message


def test_an_unreadable_rejects_file_is_its_own_fault_kind(shards, monkeypatch):
    """A rejects.jsonl this user may not read (chmod 000; where the tests run as root, which
    reads it anyway, the refusal injected) is `unreadable_rejects`: its contents are unknown, so
    no `rejects_mismatch` is claimed."""
    import shards_schema.verify as verify_module
    from tests.helpers.damage import refuse_reads

    path = shards / "rejects.jsonl"
    refuse_reads(monkeypatch, [path], [verify_module])
    try:
        report = verify_shards(shards, quick=True)
    finally:
        path.chmod(0o644)
    assert kinds(report) == {"unreadable_rejects"}, report.faults
    assert report.faults[0].message == ("rejects.jsonl cannot be read (Permission denied): its rejected rows cannot be "
                                        "checked; fix its permissions")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_rejects_path_that_is_no_file_is_named_as_such(shards, kind):
    """A directory or a FIFO where rejects.jsonl belongs is named by its kind (not `missing`), and
    the FIFO is never opened: verify returns instead of waiting for a writer."""
    path = shards / "rejects.jsonl"
    path.unlink()
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    report = verify_shards(shards, quick=True)
    assert kinds(report) == {"unreadable_rejects"}, report.faults
    what = "a directory" if kind == "directory" else r"a FIFO \(named pipe\)"
    assert re.fullmatch(rf"rejects\.jsonl is {what}, not a regular file: its rejected rows cannot be checked; "
                        r"replace it with the rejects\.jsonl the job wrote, or re-run the job", report.faults[0].message)


# --------------------------------------------------------------------------- repeated ids


def test_repeated_input_ids_preprocess_and_verify_with_a_warning(tmp_path, capsys):
    rows = example_rows(9, seed=3, size_range=(32, 96))
    for i, row in enumerate(rows):
        row["id"] = ["a", "b", "a", "c", "a", "b", "d", "e", "f"][i]  # "a" 3 times, "b" twice
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "out"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, rows_per_shard=4, progress=False))
    report = verify_shards(out)
    assert report.ok and report.fault_counts == {}
    assert report.warning_counts == {"duplicate_sample_uid": 2}
    by_uid = {w.message.split()[1]: w for w in report.warnings}
    assert set(by_uid) == {"'a'", "'b'"}
    assert "'a' occurs 3 times; first at shard-000000.arrow row 0" in by_uid["'a'"].message
    assert (by_uid["'a'"].shard, by_uid["'a'"].row) == ("shard-000000.arrow", 2)
    rc, text = verify_cli(out, capsys=capsys)
    assert rc == 0, text
    assert "WARNING shard-000000.arrow row 2: [duplicate_sample_uid] sample_uid 'a' occurs 3 times" in text
    assert "FAULT" not in text and "OK:" in text and "warnings: duplicate_sample_uid 2" in text
    rc, text = verify_cli(out, "--json", capsys=capsys)
    data = json.loads(text)
    assert rc == 0 and data["ok"] is True and data["warning_counts"] == {"duplicate_sample_uid": 2}
    assert len(data["warnings"]) == 2 and data["fault_counts"] == {}


def test_a_repeated_uid_with_a_fault_still_fails(shards, capsys):
    def mutate(samples):
        samples[3].sample_uid = samples[1].sample_uid
        samples[2].source = samples[0].source

    file = rewrite_shard(shards, 1, mutate)
    report = verify_shards(shards)
    assert report.fault_counts == {"duplicate_source": 1} and report.warning_counts == {"duplicate_sample_uid": 1}
    rc, text = verify_cli(shards, capsys=capsys)
    assert rc == 1
    assert f"FAULT {file} row 2: [duplicate_source] source " in text and f"WARNING {file} row 3: [duplicate_sample_uid]" in text
    assert "FAILED: 1 faults (duplicate_source 1)" in text and "warnings: duplicate_sample_uid 1" in text


# --------------------------------------------------------------------------- rows (checksums made consistent)


def _target_on_image_pad(samples, sp):
    j = first_row(samples, with_images=True)
    samples[j].loss_mask[np.flatnonzero(samples[j].input_ids == sp["image_pad"])[0]] = 1
    return j


def _target_on_user_turn(samples, sp):
    j = first_row(samples, with_images=False)
    assert samples[j].input_ids[0] == sp["im_start"] and samples[j].loss_mask[1] == 0
    samples[j].loss_mask[1] = 1  # the role token of the first (system/user) turn
    return j


def _target_on_assistant_header(samples, sp):
    j = first_row(samples, with_images=False)
    ids = samples[j].input_ids
    header = np.flatnonzero((ids[:-1] == sp["im_start"]) & (ids[1:] == sp["assistant"]))[0]
    samples[j].loss_mask[header + 1] = 1
    return j


def _wrong_positions_image_row(samples, sp):
    j = first_row(samples, with_images=True)
    samples[j].position_ids[1, np.flatnonzero(samples[j].input_ids == sp["image_pad"])[-1]] += 1
    return j


def _wrong_positions_text_row(samples, sp):
    j = first_row(samples, with_images=False)
    samples[j].position_ids[2, -1] += 1
    return j


def _remove_first(sample, token: int) -> None:
    """Delete the first `token` of a sample from its ids, mask and positions."""
    cut = np.flatnonzero(sample.input_ids == token)[0]
    sample.input_ids, sample.loss_mask = np.delete(sample.input_ids, cut), np.delete(sample.loss_mask, cut)
    sample.position_ids = np.ascontiguousarray(np.delete(sample.position_ids, cut, axis=1))


def _image_pad_removed(samples, sp):
    j = first_row(samples, with_images=True)
    _remove_first(samples[j], sp["image_pad"])
    return j


def _vision_end_replaced(samples, sp):
    j = first_row(samples, with_images=True)
    samples[j].input_ids[np.flatnonzero(samples[j].input_ids == sp["vision_end"])[0]] = 11  # "," : plain text
    return j


def _no_targets(samples, sp):
    j = first_row(samples, with_images=False)
    samples[j].loss_mask[:] = 0
    return j


def _token_id_set(samples, value: int) -> int:
    """Row j's first text token of a user turn (no target, no marker) given id `value`."""
    j = first_row(samples, with_images=False)
    ids = samples[j].input_ids
    k = int(np.flatnonzero(samples[j].loss_mask == 0)[1])  # past <|im_start|>: the role's own token
    samples[j].input_ids = np.asarray([*ids[:k], value, *ids[k + 1:]], dtype=ids.dtype)
    return j


def _token_id_negative(samples, sp):
    return _token_id_set(samples, -5)


def _video_patch_dropped(samples, sp):
    j = video_row(samples)
    samples[j].video_patches = np.ascontiguousarray(samples[j].video_patches[:-1])
    return j


def _video_pad_removed(samples, sp):
    j = video_row(samples)
    _remove_first(samples[j], sp["video_pad"])
    return j


def _wrong_positions_video_row(samples, sp):
    j = video_row(samples)
    samples[j].position_ids[0, np.flatnonzero(samples[j].input_ids == sp["video_pad"])[-1]] += 1
    return j


def _target_on_video_pad(samples, sp):
    j = video_row(samples)
    samples[j].loss_mask[np.flatnonzero(samples[j].input_ids == sp["video_pad"])[0]] = 1
    return j


def _first_timestamp(sample, sp) -> tuple[int, int]:
    """[begin, end) of the first video's first `<t seconds>` text: between the template's
    <|vision_start|> and the group's own."""
    ids = sample.input_ids
    start = int(np.flatnonzero(ids == sp["video_pad"])[0])
    begin = int(np.flatnonzero(ids[: start - 1] == sp["vision_start"])[-1]) + 1
    return begin, start - 1


def _timestamp_misspelt(samples, sp):
    j = video_row(samples)
    begin, _ = _first_timestamp(samples[j], sp)
    samples[j].input_ids[begin] = 87  # "<" -> "x": the same token count, so positions still hold
    return j


def _timestamp_goes_back(samples, sp):
    from preprocess.profiles import builtin_profile

    j = video_row(samples)
    begin, end = _first_timestamp(samples[j], sp)
    late = builtin_profile("qwen3-vl").tokenizer.encode("<9.9 seconds>", add_special_tokens=False).ids
    assert len(late) == end - begin and samples[j].video_grid_thw[0, 0] >= 2  # the generated videos last 2-5 s
    samples[j].input_ids[begin:end] = late
    return j


def _duplicate_source(samples, sp):
    samples[3].source = samples[1].source
    return None


ROW_FAULTS = {
    "target_on_vision_token": _target_on_image_pad,
    "target_outside_assistant": _target_on_user_turn,
    "position_ids": _wrong_positions_image_row,
    "image_pad_count": _image_pad_removed,
    "vision_markers": _vision_end_replaced,
    "no_targets": _no_targets,
    "token_id": _token_id_negative,
    "duplicate_source": _duplicate_source,
    "video_patches_length": _video_patch_dropped,
    "video_pad_count": _video_pad_removed,
}
# faults in rows with videos whose kind is already exercised on image rows
VIDEO_ROW_FAULTS = {"position_ids": _wrong_positions_video_row, "target_on_vision_token": _target_on_video_pad,
                    "video_timestamps": _timestamp_misspelt, "video_timestamps_order": _timestamp_goes_back}


@pytest.mark.parametrize("kind", sorted(ROW_FAULTS))
def test_row_fault_only_full_mode_catches(shards, kind, capsys):
    sp = special(shards)
    holder = {}
    file = rewrite_shard(shards, 1, lambda samples: holder.update(row=ROW_FAULTS[kind](samples, sp)))
    rc, out = verify_cli(shards, "--quick", capsys=capsys)
    assert rc == 0, out  # sha256, sizes and per-shard sums all agree: quick cannot see row contents
    report = verify_shards(shards)
    assert kinds(report) == {kind}, report.format_text()
    assert report.fault_counts[kind] == 1
    rc, out = verify_cli(shards, capsys=capsys)
    assert rc == 1
    if holder["row"] is None:
        assert f"{file} row 1" in out and f"{file} row 3" in out
    else:
        fault = report.faults[0]
        assert (fault.shard, fault.row) == (file, holder["row"])
        assert f"FAULT {file} row {holder['row']}: [{kind}]" in out


def test_a_token_id_past_the_vocabulary_is_a_fault_and_show_names_it(shards, capsys):
    """An id the tokenizer does not have (past its vocabulary, or negative) is a `token_id`
    fault; `show` of that sample exits 2 naming the token, where decoding it crashed."""
    holder = {}
    file = rewrite_shard(shards, 1, lambda samples: holder.update(row=_token_id_set(samples, 10**9)))
    report = verify_shards(shards)
    assert kinds(report) == {"token_id"} and "id 1000000000" in report.faults[0].message, report.format_text()
    index = sum(entry["rows"] for entry in manifest_of(shards)["shards"][:1]) + holder["row"]
    capsys.readouterr()
    assert cli_main(["show", str(shards), "--index", str(index)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"sample {index} of {shards}: token " in err and "has id 1000000000" in err, err
    assert file


@pytest.mark.parametrize("kind", sorted(VIDEO_ROW_FAULTS))
def test_video_row_faults(shards, kind):
    sp = special(shards)
    holder = {}
    file = rewrite_shard(shards, 1, lambda samples: holder.update(row=VIDEO_ROW_FAULTS[kind](samples, sp)))
    report = verify_shards(shards)
    assert kinds(report) == {kind.removesuffix("_order")}, report.format_text()
    detail = {"video_timestamps": "is not '<t.t seconds>'", "video_timestamps_order": "go back in time"}.get(kind, "")
    assert detail in report.faults[0].message
    assert (report.faults[0].shard, report.faults[0].row) == (file, holder["row"])


def test_more_row_faults_named_precisely(shards):
    sp = special(shards)
    rows = {}

    def mutate(samples):
        rows["header"] = _target_on_assistant_header(samples, sp)
        rows["text_pos"] = _wrong_positions_text_row(samples, sp)

    file = rewrite_shard(shards, 0, mutate)
    report = verify_shards(shards)
    assert kinds(report) == {"target_outside_assistant", "position_ids"}
    by_kind = {f.kind: f for f in report.faults}
    assert by_kind["position_ids"].row == rows["text_pos"] and "position_ids[2, " in by_kind["position_ids"].message
    assert by_kind["target_outside_assistant"].shard == file


def test_assistant_turn_cut_by_truncation_is_valid(shards):
    """--truncate may cut the last assistant turn before its <|im_end|>: targets then run to the row end."""
    sp = special(shards)

    def cut(samples):
        for s in samples[:3]:
            end = np.flatnonzero(s.input_ids == sp["im_end"])[-1]
            s.input_ids, s.loss_mask = s.input_ids[:end].copy(), s.loss_mask[:end].copy()
            s.position_ids = np.ascontiguousarray(s.position_ids[:, :end])
            assert s.loss_mask.any()

    rewrite_shard(shards, 2, cut)
    assert verify_shards(shards).ok


def test_fault_output_is_capped_but_exit_code_counts_all(shards, capsys):
    def shift_all(samples):
        for s in samples:
            s.position_ids += 1

    file = rewrite_shard(shards, 0, shift_all)
    n = manifest_of(shards)["shards"][0]["rows"]
    rc, out = verify_cli(shards, "--max-faults", "2", capsys=capsys)
    assert rc == 1
    assert out.count("[position_ids]") == 3  # 2 listed + the "... more" line
    assert f"[position_ids] {n - 2} more (of {n}" in out
    assert f"FAULT {file} row 0: [position_ids]" in out
    report = verify_shards(shards, keep_per_kind=3)
    assert report.fault_counts == {"position_ids": n} and len(report.faults) == 3


def test_workers_give_the_same_report(shards):
    def spoil(samples):
        samples[2].loss_mask[1] = 1

    rewrite_shard(shards, 2, spoil)
    (shards / "shard-000001.arrow").write_bytes(b"garbage")
    one, two = verify_shards(shards), verify_shards(shards, workers=2)
    assert one.faults == two.faults and one.fault_counts == two.fault_counts
    assert kinds(one) == {"size_mismatch", "unreadable_shard", "target_outside_assistant"}


def test_per_row_position_fallback(shards, monkeypatch):
    """If the one-call-per-slice recomputation fails, rows are recomputed one by one and still named."""
    import shards_schema.verify as verify_module

    sp = special(shards)
    rows = {}
    file = rewrite_shard(shards, 0, lambda samples: rows.update(row=_wrong_positions_image_row(samples, sp)))
    real, calls = verify_module.mrope_position_ids, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_module, "mrope_position_ids", failing_once)
    report = verify_shards(shards)
    assert kinds(report) == {"position_ids"}
    assert (report.faults[0].shard, report.faults[0].row) == (file, rows["row"])
    assert "HF get_rope_index" in report.faults[0].message


def test_json_report_lists_faults(shards, capsys):
    sp = special(shards)
    rows = {}
    file = rewrite_shard(shards, 2, lambda samples: rows.update(row=_target_on_image_pad(samples, sp)))
    rc, out = verify_cli(shards, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False and data["fault_counts"] == {"target_on_vision_token": 1}
    assert data["faults"] == [{"kind": "target_on_vision_token", "shard": file, "row": rows["row"],
                               "message": data["faults"][0]["message"]}]
