"""The batch job: accounting, determinism across worker counts, resume after a kill,
partitions + merge, input formats, rejects that never stop the job, fail-fast config errors."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from preprocess.errors import ConfigError
from preprocess.examples import encode_data_uri, example_rows, synthetic_image, write_jsonl
from preprocess.job import PreprocessConfig, idle_workers_note, merge_partitions, run_preprocess
from preprocess.pipeline import SampleOptions
from shards_schema import open_shards, storage
from shards_schema.errors import UserError
from shards_schema.writer import file_sha256
from tests.helpers.cli import vlmpack_exit_code
from tests.helpers.model_dirs import qwen3_vl_model_dir

ROWS = 30


@pytest.fixture(scope="module")
def example_jsonl(tmp_path_factory):
    rows = example_rows(ROWS, seed=7, size_range=(32, 160), include_bad_rows=True)
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", rows)


def _run(inputs, out, **kw) -> dict:
    kw.setdefault("progress", False)
    kw.setdefault("rows_per_shard", 8)
    return run_preprocess(PreprocessConfig(inputs=[str(p) for p in inputs], out=str(out), **kw))


def _shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.arrow"))}


def _without_run(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "_run"}


@pytest.fixture(scope="module")
def baseline(example_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    return out, _run([example_jsonl], out, workers=1)


def test_accounting_checksums_and_reader(baseline):
    out, manifest = baseline
    acc, totals = manifest["accounting"], manifest["totals"]
    assert acc["rows_read"] == ROWS + 2
    assert acc["rows_read"] == acc["rows_written"] + acc["rows_rejected"]
    assert acc["rejects_by_reason"] == {"bad_base64": 1, "unknown_role": 1}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == acc["rows_rejected"]
    assert {(r["row"], r["code"]) for r in rejects} == {(ROWS, "bad_base64"), (ROWS + 1, "unknown_role")}
    for shard in manifest["shards"]:
        path = out / shard["file"]
        assert file_sha256(path) == shard["sha256"] and path.stat().st_size == shard["bytes"]
    shards = open_shards(out)
    assert len(shards) == acc["rows_written"] == totals["rows"]
    stats = shards.sample_stats()
    assert stats["num_tokens"].sum() == totals["tokens"]
    assert stats["num_target_tokens"].sum() == totals["target_tokens"]
    assert stats["num_patches"].sum() == totals["patches"]
    width = manifest["patch_row_width"]
    for i in range(len(shards)):
        s = shards[i]
        L = len(s["input_ids"])
        assert s["input_ids"].dtype == np.int32 and s["loss_mask"].dtype == np.uint8
        assert s["position_ids"].shape == (3, L) and s["position_ids"].dtype == np.int32
        assert s["pixel_patches"].dtype == np.uint8 and s["pixel_patches"].shape[1] == width
        assert s["image_grid_thw"].dtype == np.int32
        assert int(s["image_grid_thw"].prod(axis=1).sum()) == s["pixel_patches"].shape[0]
        assert s["loss_mask"].sum() == stats["num_target_tokens"][i] > 0
        assert s["sample_uid"] == f"example-{i:05d}"  # row ids become uids; rows keep their input order
        assert not s["input_ids"].flags.writeable or s["input_ids"].base is not None  # a view, not a copy


def test_same_bytes_whatever_the_worker_count(example_jsonl, baseline, tmp_path):
    out1, manifest1 = baseline
    manifest2 = _run([example_jsonl], tmp_path, workers=2)
    assert _shard_bytes(out1) == _shard_bytes(tmp_path)
    assert _without_run(manifest1) == _without_run(manifest2)
    assert (out1 / "rejects.jsonl").read_bytes() == (tmp_path / "rejects.jsonl").read_bytes()
    assert (out1 / "manifest.json").read_bytes() == (tmp_path / "manifest.json").read_bytes()


def test_fewer_units_than_workers_gets_a_note_with_a_shard_size_that_fits(example_jsonl, tmp_path, capsys):
    manifest = _run([example_jsonl], tmp_path, workers=4, rows_per_shard=1000)
    rows = manifest["accounting"]["rows_read"]
    err = capsys.readouterr().err
    assert "note: 1 work unit for 4 workers, so at most 1 run at once (a unit is one shard of --rows-per-shard 1000" in err
    assert f"--rows-per-shard {-(-rows // 16)} gives every worker about 4" in err


@pytest.mark.parametrize("units, rows, workers, note", [
    (8, 8000, 16, "vlmpack preprocess: note: 8 work units for 16 workers, so at most 8 run at once (a unit is one shard of --rows-per-shard 1024 "
                  "rows); --rows-per-shard 125 gives every worker about 4"),
    (16, 8000, 16, None),  # every worker has a unit
    (1, 3, 8, None),  # fewer rows than workers: no shard size helps
    (1, 1000, 1, None),  # one worker
])
def test_idle_workers_note(units, rows, workers, note):
    assert idle_workers_note(units, rows, workers, 1024) == note


def test_resume_after_kill_equals_uninterrupted_run(example_jsonl, baseline, tmp_path):
    """SIGKILL a real 2-worker job once it has committed a unit; the re-run redoes only the rest."""
    out = tmp_path / "shards"
    cmd = [sys.executable, "-m", "shards_schema.cli", "preprocess", str(example_jsonl), "--out", str(out),
           "--workers", "2", "--rows-per-shard", "4", "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "_parts").glob("unit-*.json")):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists() or proc.returncode == 0
    committed = len(list((out / "_parts").glob("unit-*.json")))
    manifest = _run([example_jsonl], out, workers=2, rows_per_shard=4)
    assert manifest["_run"]["units_resumed"] == committed >= 1
    reference = _run([example_jsonl], tmp_path / "ref", workers=1, rows_per_shard=4)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "ref")
    assert _without_run(manifest) == _without_run(reference)


def test_partitions_then_merge_equal_one_job(example_jsonl, baseline, tmp_path):
    out1, manifest1 = baseline
    dirs = []
    for i in range(3):
        d = tmp_path / f"part{i}"
        summary = _run([example_jsonl], d, workers=1, num_partitions=3, partition_index=i)
        assert "totals" not in summary and not (d / "manifest.json").exists()
        dirs.append(d)
    with pytest.raises(ConfigError, match=r"not done \(first: \[\d+(, \d+)*\]\); run the missing"):
        merge_partitions([str(dirs[0]), str(dirs[1])], str(tmp_path / "incomplete"))
    with pytest.raises(ConfigError, match=f"partition {dirs[0]} is named twice: name each partition's --out once"):
        merge_partitions([str(dirs[0]), str(dirs[1]), str(dirs[0])], str(tmp_path / "incomplete"))
    # a FIFO in place of a unit's record is a unit not done, never waited on
    shutil.copytree(dirs[2], tmp_path / "fifo2")
    record = sorted((tmp_path / "fifo2" / "_parts").glob("unit-*.json"))[0]
    record.unlink()
    os.mkfifo(record)
    with pytest.raises(ConfigError, match="missing or damaged|not done"):
        merge_partitions([str(dirs[0]), str(dirs[1]), str(tmp_path / "fifo2")], str(tmp_path / "with-fifo"))
    merged = merge_partitions([str(d) for d in dirs], str(tmp_path / "merged"))
    assert _shard_bytes(tmp_path / "merged") == _shard_bytes(out1)
    assert merged == _without_run(manifest1)
    # a partition given twice, one copy damaged: the intact copy is used, in either order
    shutil.copytree(dirs[0], tmp_path / "copy0")
    shard = sorted((tmp_path / "copy0").glob("*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for k, order in enumerate(([tmp_path / "copy0", *dirs], [*dirs, tmp_path / "copy0"])):
        assert merge_partitions([str(d) for d in order], str(tmp_path / f"overlap{k}")) == _without_run(manifest1)
        assert _shard_bytes(tmp_path / f"overlap{k}") == _shard_bytes(out1)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'copy0'}: the shard of unit 0 is missing or damaged"):
        merge_partitions([str(tmp_path / "copy0"), str(dirs[1]), str(dirs[2])], str(tmp_path / "damaged"))


def test_a_partition_named_twice_is_refused_naming_both_spellings(tmp_path, monkeypatch, capsys):
    """One partition directory or store prefix named twice to merge, however spelled, is refused
    before anything is read, naming it (and the first spelling): never a count of units not done."""
    (tmp_path / "p0").mkdir()
    (tmp_path / "link").symlink_to("p0")
    monkeypatch.chdir(tmp_path)
    for dirs, named in ((["p0", "p0"], "partition p0 is named twice"),
                        (["p0", "./p0/"], "partition ./p0/ is the same directory as p0"),
                        (["p0", "link"], "partition link is the same directory as p0"),
                        (["s3://bkt/p0", "s3a://bkt/p0/"],
                         "partition s3a://bkt/p0/ is the same prefix as s3://bkt/p0")):
        assert vlmpack_exit_code(["merge", *dirs, "--out", "merged"]) == 2, dirs
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{named}: name each partition's --out once, all of them" in err, (dirs, err)
    assert sorted(os.listdir(tmp_path)) == ["link", "p0"]


DAMAGED_RECORDS = {  # a `_parts` file of a finished job, and what it is made to hold
    "job.json a list": ("job.json", [1, 2]),
    "job.json a string": ("job.json", "str"),
    "job.json inputs a number": ("job.json", {"inputs": 5}),
    "job.json inputs of numbers": ("job.json", {"inputs": [5]}),
    "job.json without settings": ("job.json", "{inputs only}"),
    "job.json not JSON": ("job.json", None),
    "unit record a list": ("unit-000000.json", [1]),
    "unit record not JSON": ("unit-000000.json", None),
    "unit record with rows as text": ("unit-000000.json", {"rows": "x"}),
    "unit record whose rows do not add up": ("unit-000000.json", "{one more row read}"),
    "inputs_seen.json a list of numbers": ("inputs_seen.json", [1]),
}


def _damage(out: Path, name: str, value) -> None:
    path = out / "_parts" / name
    if value == "{inputs only}":
        value = {"inputs": json.loads(path.read_text())["inputs"]}
    if value == "{one more row read}":  # well-formed, but no manifest's accounting adds up from it
        record = json.loads(path.read_text())
        value = {**record, "rows_read": record["rows_read"] + 1}
    path.write_text("{bad" if value is None else json.dumps(value))


@pytest.mark.parametrize("case", list(DAMAGED_RECORDS))
def test_a_damaged_work_record_is_redone_or_refused_in_one_line(case, example_jsonl, baseline, tmp_path, capsys):
    """A `_parts` file damaged or edited by hand: resuming the job redoes a unit whose record is
    damaged, reads a damaged inputs_seen.json as absent, and refuses a damaged job.json in one
    line (exit 2); `vlmpack merge` refuses either damaged file in one line, naming it."""
    name, value = DAMAGED_RECORDS[case]
    out, merged = tmp_path / "out", tmp_path / "merged"
    shutil.copytree(baseline[0], out)
    (out / "manifest.json").unlink()  # a job stopped before its end: resumable
    _damage(out, name, value)
    capsys.readouterr()
    code = vlmpack_exit_code(["preprocess", str(example_jsonl), "--out", str(out), "--workers", "1", "--rows-per-shard",
                              "8", "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if name == "job.json" and value is not None:
        assert code == 2 and err.count("\n") == 1 and "job.json is damaged (" in err and "--out" in err, err
    elif name == "job.json":  # not JSON: the directory holds no job it can resume
        assert code == 2 and err.count("\n") == 1 and "holds no resumable job" in err, err
    else:
        assert code == 0, err
        assert _shard_bytes(out) == _shard_bytes(baseline[0])
        assert _without_run(json.loads((out / "manifest.json").read_text())) == _without_run(baseline[1])
    if name == "inputs_seen.json":
        return
    shutil.rmtree(out)
    shutil.copytree(baseline[0], out)
    _damage(out, name, value)
    capsys.readouterr()
    code = vlmpack_exit_code(["merge", str(out), "--out", str(merged)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert ("job.json is damaged (" if name == "job.json" else "the shard of unit 0 is missing or damaged") in err, err


def test_partitions_sharing_one_directory(example_jsonl, baseline, tmp_path):
    for i in range(2):
        _run([example_jsonl], tmp_path, workers=1, num_partitions=2, partition_index=i)
    merged = merge_partitions([str(tmp_path)], str(tmp_path))
    assert merged == _without_run(baseline[1])


def test_a_partition_past_the_jobs_units_says_so_and_the_merge_still_equals_one_job(example_jsonl, baseline,
                                                                                     tmp_path, capsys):
    """--num-partitions above the job's work units: a partition holding none writes nothing and
    says why, naming the count; the merge of all of them is the one job's output."""
    from tests.helpers.cli import vlmpack_exit_code

    units = baseline[1]["totals"]["shards"]
    for i in range(units + 1):
        assert vlmpack_exit_code(["preprocess", str(example_jsonl), "--out", str(tmp_path), "--workers", "1",
                                  "--rows-per-shard", "8", "--no-progress", "--num-partitions", str(units + 1),
                                  "--partition-index", str(i)]) == 0
        err = capsys.readouterr().err
        if i < units:
            assert "note: --num-partitions" not in err, err
    assert (f"vlmpack preprocess: note: --num-partitions {units + 1} is more than the job's {units} work unit"
            f"{'s' if units != 1 else ''}, so partition {units} has none: partitions {units} to {units} write "
            "nothing") in err, err
    assert merge_partitions([str(tmp_path)], str(tmp_path)) == _without_run(baseline[1])


def test_jobs_recorded_before_profiles_held_the_template_text_resume_and_merge(example_jsonl, baseline, tmp_path):
    """A job recorded when the profile held its chat template's sha256 but not the text is the
    same job: a re-run resumes it, a merge joins its partition with a newer one, and the
    manifest gets the text."""
    def drop_template_text(directory: Path) -> None:
        job_file = directory / "_parts" / "job.json"
        recorded = json.loads(job_file.read_text())
        del recorded["profile"]["chat_template"]
        job_file.write_text(json.dumps(recorded))

    out = tmp_path / "resumed"
    _run([example_jsonl], out, workers=1)
    drop_template_text(out)
    (out / "manifest.json").unlink()
    manifest = _run([example_jsonl], out, workers=1)
    assert manifest["_run"]["units_resumed"] == manifest["totals"]["shards"]
    assert _without_run(manifest) == _without_run(baseline[1]) and "chat_template" in manifest["profile"]
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for i, directory in enumerate(parts):
        _run([example_jsonl], directory, workers=1, num_partitions=2, partition_index=i)
    drop_template_text(parts[0])
    assert merge_partitions([str(d) for d in parts], str(tmp_path / "merged")) == _without_run(baseline[1])


def test_jobs_recorded_before_a_sample_setting_existed_resume_at_its_default(example_jsonl, baseline, tmp_path):
    """A job recorded by a vlmpack without `add_vision_id` and `preserve_thinking` (settings it
    could not set) resumes as the same job with them off; asked to turn one on, it is refused."""
    out = tmp_path / "resumed"
    _run([example_jsonl], out, workers=1)
    job_file = out / "_parts" / "job.json"
    recorded = json.loads(job_file.read_text())
    del recorded["settings"]["add_vision_id"], recorded["settings"]["preserve_thinking"]
    job_file.write_text(json.dumps(recorded))
    (out / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="differs in: settings"):
        _run([example_jsonl], out, workers=1, sample=SampleOptions(add_vision_id=True))
    manifest = _run([example_jsonl], out, workers=1)
    assert manifest["_run"]["units_resumed"] == manifest["totals"]["shards"]
    assert _without_run(manifest) == _without_run(baseline[1])


def test_slurm_array_recipe_then_merge_equal_one_job(example_jsonl, baseline, tmp_path):
    """docs/recipes/slurm_preprocess.sbatch run as a 3-task array would run it (the tasks at once,
    Slurm's array variables set), then the merge it documents: one job's bytes."""
    script = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "slurm_preprocess.sbatch"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "INPUTS": str(example_jsonl), "OUT": str(tmp_path / "parts"), "SLURM_ARRAY_TASK_COUNT": "3",
           "SLURM_CPUS_PER_TASK": "1", "EXTRA_ARGS": "--rows-per-shard 8"}
    tasks = [subprocess.Popen(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for task in tasks:
        out, err = task.communicate(timeout=300)
        assert task.returncode == 0, err
        assert "When all partitions are done: vlmpack merge" in out
    merged = subprocess.run([sys.executable, "-m", "shards_schema.cli", "merge",
                             *sorted(str(p) for p in (tmp_path / "parts").glob("part-*")), "--out", str(tmp_path / "shards")],
                            capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr
    assert _shard_bytes(tmp_path / "shards") == _shard_bytes(baseline[0])
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text()) == _without_run(baseline[1])


def test_rerun_with_other_settings_is_refused(example_jsonl, baseline, tmp_path):
    _run([example_jsonl], tmp_path, workers=1)
    with pytest.raises(ConfigError, match="different job.*settings"):
        _run([example_jsonl], tmp_path, workers=1, sample=SampleOptions(max_seq_len=999))



def test_worker_pool_started_before_the_input_scan_ends_with_the_job_however_it_ends(example_jsonl, tmp_path):
    """The local pool starts before the inputs are scanned; a job refused after that (here: the
    output directory holds another job) and a job that finishes both leave no worker behind."""
    import multiprocessing as mp

    before = set(mp.active_children())
    manifest = _run([example_jsonl], tmp_path, workers=2, rows_per_shard=4)
    assert manifest["accounting"]["rows_read"] == ROWS + 2
    assert set(mp.active_children()) == before
    with pytest.raises(ConfigError, match="different job.*settings"):
        _run([example_jsonl], tmp_path, workers=2, rows_per_shard=4, sample=SampleOptions(max_seq_len=999))
    assert set(mp.active_children()) == before


def test_workers_started_before_the_scan_follow_the_inputs_size(tmp_path):
    from preprocess.job.local import EARLY_ROW_BYTES, _early_workers

    unit_bytes = 1024 * EARLY_ROW_BYTES
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    with open(big, "wb") as f:
        f.truncate(5 * unit_bytes)  # sparse: only its size matters here
    small.write_text('{"messages": []}\n')
    cfg = PreprocessConfig(inputs=[str(big)], out=str(tmp_path / "o"), workers=8, rows_per_shard=1024)
    assert _early_workers(cfg) == 5
    assert _early_workers(dataclasses.replace(cfg, workers=3)) == 3
    assert _early_workers(dataclasses.replace(cfg, num_partitions=5)) == 1
    assert _early_workers(dataclasses.replace(cfg, inputs=[str(small)])) == 1
    assert _early_workers(dataclasses.replace(cfg, inputs=[str(tmp_path / "missing.jsonl")])) == 0
    assert _early_workers(dataclasses.replace(cfg, inputs=["s3://bucket/chats.jsonl"])) == 0  # no store round trip

def test_all_input_formats_give_the_same_samples(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow stores every struct key of a part, absent ones as null: the renderer must treat a
    # null key as absent (the jinja templates would count `'image_url' in part` as an image).
    rows = _uniform(example_rows(6, seed=3, size_range=(32, 96)))
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "a_ds"))
    results = {}
    for name in ("a.jsonl", "a.json", "a.parquet", "a_ds"):
        out = tmp_path / f"out_{name}"
        manifest = _run([tmp_path / name], out, workers=1, rows_per_shard=4)
        assert manifest["accounting"]["rows_rejected"] == 0, name
        shards = open_shards(out)
        results[name] = [{k: v for k, v in shards[i].items() if k != "source"} for i in range(len(shards))]
    reference = results.pop("a.jsonl")
    assert len(reference) == 6
    for name, samples in results.items():
        for a, b in zip(reference, samples, strict=True):
            for key in a:
                assert np.array_equal(a[key], b[key]) if isinstance(a[key], np.ndarray) else a[key] == b[key], (name, key)


def _uniform(rows):
    """Give every content part all keys so Arrow infers one struct type (datasets does the same)."""
    keys = ("type", "text", "image_url")
    out = []
    for r in rows:
        msgs = []
        for m in r["messages"]:
            content = m["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            content = [{k: p.get(k) for k in keys} for p in content]
            msgs.append({"role": m["role"], "content": content})
        out.append({"id": r["id"], "messages": msgs})
    return out


def _png_data_uri(w, h):
    return encode_data_uri(synthetic_image(np.random.default_rng(0), w, h), "PNG")


def _jpeg_bytes(w=64, h=48):
    buf = io.BytesIO()
    synthetic_image(np.random.default_rng(1), w, h).save(buf, format="JPEG")
    return buf.getvalue()


def _chat(image_url=None, text="What is this?", role="user"):
    parts = [{"type": "text", "text": text}]
    if image_url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"messages": [{"role": role, "content": parts}, {"role": "assistant", "content": "An answer."}]}


def test_bad_rows_are_recorded_and_never_stop_the_job(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "ok.jpg").write_bytes(_jpeg_bytes())
    (media / "truncated.jpg").write_bytes(_jpeg_bytes(200, 150)[:600])
    (media / "noise.png").write_bytes(os.urandom(300))
    (tmp_path / "secret.jpg").write_bytes(_jpeg_bytes())
    lines = [
        json.dumps(_chat("ok.jpg")),  # good
        "{not json",
        "",
        json.dumps({"conversation": []}),
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 42}]}, {"role": "assistant", "content": "x"}]}),
        json.dumps(_chat("data:image/png;base64,!!!!")),
        json.dumps(_chat("truncated.jpg")),
        json.dumps(_chat("noise.png")),
        json.dumps(_chat("https://example.com/cat.png")),
        json.dumps(_chat("../secret.jpg")),
        json.dumps(_chat(_png_data_uri(400, 300))),  # over the small pixel cap below
        json.dumps(_chat(_png_data_uri(2, 500))),  # aspect ratio 250
        json.dumps(_chat(text="word " * 3000)),  # too long
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no", "train": False}]}),
        json.dumps(_chat("data:image/jpeg;base64," + base64.b64encode(_jpeg_bytes()).decode())),  # good
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    manifest = _run([data], tmp_path / "out", workers=2, rows_per_shard=5,
                    sample=SampleOptions(media_root=str(media), max_image_pixels=100_000, max_seq_len=2048))
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    codes = {r["row"]: r["code"] for r in rejects}
    assert codes == {
        1: "bad_json", 3: "no_messages", 4: "no_messages", 5: "unknown_role", 6: "bad_content",
        7: "bad_base64", 8: "bad_image", 9: "not_an_image", 10: "remote_url", 11: "path_outside_media_root",
        12: "image_too_large", 13: "aspect_ratio", 14: "too_long", 15: "no_targets",
    }
    assert all(r["reason"] and r["source"] == str(data) for r in rejects)
    assert manifest["accounting"]["rows_written"] == 2 and manifest["accounting"]["rows_read"] == len(lines) - 1  # the blank line is no row
    assert [open_shards(tmp_path / "out")[i]["sample_uid"] for i in range(2)] == [f"{data}:0", f"{data}:16"]


def test_truncate_never_cuts_an_image(tmp_path):
    long_text = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "word " * 500}]}
    image_late = {"messages": [{"role": "user", "content": [{"type": "text", "text": "word " * 500},
                  {"type": "image_url", "image_url": {"url": _png_data_uri(64, 64)}}]}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "long.jsonl", [long_text, image_late])
    manifest = _run([data], tmp_path / "out", sample=SampleOptions(max_seq_len=128, truncate=True))
    assert manifest["accounting"]["rejects_by_reason"] == {"too_long": 1}
    sample = open_shards(tmp_path / "out")[0]
    assert len(sample["input_ids"]) == 128 and sample["loss_mask"][-1] == 1


def test_config_errors_fail_before_any_work(example_jsonl, tmp_path):
    with pytest.raises(ConfigError, match="unknown profile"):
        _run([example_jsonl], tmp_path / "a", profile="llava")
    with pytest.raises(ConfigError, match="--model"):
        _run([example_jsonl], tmp_path / "b", model=str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        _run([tmp_path / "nope.jsonl"], tmp_path / "c")
    with pytest.raises(ConfigError, match="unknown input format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        _run([tmp_path / "x.csv"], tmp_path / "d")
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_cli_quickstart_runs(tmp_path, capsys):
    result = subprocess.run([sys.executable, "-m", "shards_schema.cli", "quickstart", "--out", str(tmp_path / "qs"),
                             "--rows", "6", "--videos", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "read 10 = written 8 + rejected 2" in result.stdout
    shards = open_shards(tmp_path / "qs" / "shards")
    assert len(shards) == 8 and int(shards.sample_stats()["num_videos"].sum()) == 2
    # run again: the example file (its encoded videos included) comes out byte for byte the same
    # and is left as it was, so the job resumes instead of seeing a changed input
    example = tmp_path / "qs" / "example.jsonl"
    written = example.stat().st_mtime_ns
    code, err = _cli(capsys, "quickstart", "--out", tmp_path / "qs", "--rows", "6", "--videos", "2", "--workers", "1")
    assert code == 0, err
    assert example.stat().st_mtime_ns == written
    # other settings: quickstart knows the directory's files as its own (its marker, the
    # example's sha256) and replaces them, shards included
    code, err = _cli(capsys, "quickstart", "--out", tmp_path / "qs", "--rows", "3", "--videos", "0", "--workers", "1")
    assert code == 0, err
    assert len(open_shards(tmp_path / "qs" / "shards")) == 3 and len(example.read_text().splitlines()) == 5
    assert sorted(p.name for p in (tmp_path / "qs").iterdir()) == [".vlmpack-quickstart.json", ".vlmpack.lock",
                                                                   "example.jsonl", "shards"]


def test_quickstart_without_the_video_extra_says_it_leaves_the_videos_out(tmp_path, capsys, monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else find_spec(name, *a))
    from shards_schema.cli import main

    assert main(["quickstart", "--out", str(tmp_path / "qs"), "--rows", "3", "--videos", "2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "videos:         none generated: the video extra (PyAV, torch) is not installed" in out
    assert "the 2 video conversations are left out" in out and "read 5 = written 3 + rejected 2" in out
    assert len(open_shards(tmp_path / "qs" / "shards")) == 3


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", str(tmp_path / "missing.jsonl"),
                             "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_model_dir_profile_equals_builtin_and_pixel_bounds_override(example_jsonl, baseline, tmp_path, official_template):
    model = qwen3_vl_model_dir(tmp_path, official_template)
    manifest = _run([example_jsonl], tmp_path / "m", workers=2, model=str(model))
    assert manifest["profile"]["source"] == str(model.resolve())
    assert manifest["profile"]["id"] == baseline[1]["profile"]["id"]  # same files and constants: interchangeable
    assert _shard_bytes(tmp_path / "m") == _shard_bytes(baseline[0])

    small = _run([example_jsonl], tmp_path / "small", workers=1, model=str(model), min_pixels=32 * 32, max_pixels=160 * 160)
    assert small["profile"]["id"] != baseline[1]["profile"]["id"]
    assert small["profile"]["vision"]["max_pixels"] == 160 * 160
    grids = [open_shards(tmp_path / "small")[i]["image_grid_thw"] for i in range(small["totals"]["rows"])]
    assert all((g[:, 1] * g[:, 2] * 16 * 16 <= 160 * 160).all() for g in grids if len(g))
    assert small["totals"]["patches"] < baseline[1]["totals"]["patches"]


# ---------------------------------------------------------------- the output directory belongs to one job


def _cli(capsys, *argv) -> tuple[int, str]:
    """`vlmpack ARGV` in this process: (exit code, stderr)."""
    from shards_schema.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own refusal of an option's value
        code = exc.code
    return code, capsys.readouterr().err


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_finished_dataset_without_work_state_is_never_overwritten(example_jsonl, baseline, tmp_path, capsys):
    """A shard directory made elsewhere (e.g. by `vlmpack import`) has no `_parts/`: preprocess
    and merge into it are refused and leave every file as it was."""
    dataset = tmp_path / "imported"
    dataset.mkdir()
    for p in baseline[0].iterdir():
        if p.is_file() and not p.name.startswith("."):
            (dataset / p.name).write_bytes(p.read_bytes())
    before = _tree(dataset)
    with pytest.raises(ConfigError, match=r"is not empty and holds no resumable job of `vlmpack preprocess`.*new or empty --out"):
        _run([example_jsonl], dataset, workers=1)
    code, err = _cli(capsys, "preprocess", example_jsonl, "--out", dataset, "--workers", "1", "--no-progress")
    assert code == 2 and err.count("\n") == 1 and "not empty" in err
    part = tmp_path / "part"
    _run([example_jsonl], part, workers=1, num_partitions=2, partition_index=0)
    _run([example_jsonl], part, workers=1, num_partitions=2, partition_index=1)
    with pytest.raises(ConfigError, match="holds no resumable job of `vlmpack merge`"):
        merge_partitions([str(part)], str(dataset))
    assert {k: v for k, v in _tree(dataset).items() if not k.startswith(".")} == before
    # this job's own directory is resumable, and a merge may be re-run into its own output
    merged = merge_partitions([str(part)], str(tmp_path / "merged"))
    assert merge_partitions([str(part)], str(tmp_path / "merged")) == merged


def _snapshot(directory: Path) -> dict[str, tuple]:
    """Everything a refused command must leave as it was: each entry under `directory` (and the
    directory itself) with its kind, modification time, and a file's size and sha256."""
    import stat

    entries = {}
    for path in [directory, *sorted(directory.rglob("*"))]:
        st = path.lstat()
        is_file = stat.S_ISREG(st.st_mode)
        entries[str(path.relative_to(directory))] = (stat.S_IFMT(st.st_mode), st.st_mtime_ns,
                                                     st.st_size if is_file else None, file_sha256(path) if is_file else None)
    return entries


@pytest.fixture(scope="module")
def exported(baseline, tmp_path_factory):
    from shards_schema.webdataset.convert import export_webdataset

    out = tmp_path_factory.mktemp("exported") / "tars"
    export_webdataset(baseline[0], out)
    return out


def _other_files(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "example.jsonl").write_text('{"mine": true}\n')


def _job_dir(d: Path, data: Path) -> None:
    _run([data], d, workers=1)


def _quickstart_dir(d: Path) -> None:
    from shards_schema.cli import main

    assert main(["quickstart", "--out", str(d), "--rows", "2", "--videos", "0", "--workers", "1"]) == 0


# case -> (how the directory D is made, the refused command line, a part of its one-line error,
# whether another job holds D meanwhile). {data}: an input, {shards}: a finished shard directory,
# {tars}: its export, {parts}: a finished partition's directory.
REFUSED_OUTPUT_DIRS = {
    "preprocess into other files": (_other_files, ["preprocess", "{data}", "--out", "{D}"], "holds no resumable job", False),
    "preprocess into another job's directory": (
        _job_dir, ["preprocess", "{data}", "--out", "{D}", "--max-seq-len", "999"], "holds output of a different job (differs in: settings; --max-seq-len: ", False),
    "preprocess into a held directory": (
        _job_dir, ["preprocess", "{data}", "--out", "{D}", "--rows-per-shard", "8"], "is in use by another job", True),
    "preprocess with a bad count into a job's directory": (
        _job_dir, ["preprocess", "{data}", "--out", "{D}", "--rows-per-shard", "0"], "--rows-per-shard must be", False),
    "preprocess with a bad number into a job's directory": (
        _job_dir, ["preprocess", "{data}", "--out", "{D}", "--video-fps", "nan"], "argument --video-fps", False),
    "preprocess with an unknown profile into a job's directory": (
        _job_dir, ["preprocess", "{data}", "--out", "{D}", "--profile", "llava"], "unknown profile", False),
    "merge into other files": (_other_files, ["merge", "{parts}", "--out", "{D}"], "holds no resumable job of `vlmpack merge`", False),
    "merge into another job's directory": (_job_dir, ["merge", "{parts}", "--out", "{D}"], "holds no resumable job", False),
    "merge into a held directory": (Path.mkdir, ["merge", "{parts}", "--out", "{D}"], "is in use by another job", True),
    "quickstart into the user's example.jsonl": (
        _other_files, ["quickstart", "--out", "{D}", "--rows", "2"], "holds files quickstart did not write (example.jsonl", False),
    "quickstart into a shard directory": (
        _job_dir, ["quickstart", "--out", "{D}", "--rows", "2"], "holds files quickstart did not write (_parts", False),
    "quickstart into a held directory": (_quickstart_dir, ["quickstart", "--out", "{D}", "--rows", "2"], "is in use", True),
    "quickstart with a bad count into its own directory": (
        _quickstart_dir, ["quickstart", "--out", "{D}", "--rows", "0"], "--rows must be an integer from 1 to", False),
    "export into other files": (_other_files, ["export", "{shards}", "--out", "{D}"], "did not write (example.jsonl", False),
    "export into an export without --overwrite": (
        lambda d: _export(d), ["export", "{shards}", "--out", "{D}"], "pass --overwrite to replace it", False),
    "export into a held directory": (lambda d: _export(d), ["export", "{shards}", "--out", "{D}", "--overwrite"], "is in use", True),
    "import into other files": (_other_files, ["import", "{tars}", "--out", "{D}"], "did not write (example.jsonl", False),
    "fetch into other files": (_other_files, ["fetch", "{shards}", "{D}", "--no-progress"], "is not empty", False),
    "fetch into a file": (lambda d: d.write_text("mine"), ["fetch", "{shards}", "{D}", "--no-progress"],
                          "the destination {D} is a file, not a directory", False),
    "fetch into another dataset": (_job_dir, ["fetch", "{shards_other}", "{D}", "--no-progress"], "holds another dataset", False),
    "pack into other files": (_other_files, ["pack", "{shards}", "--seq-len", "16384", "--out", "{D}"], "is not a pack plan", False),
}


def _export(d: Path) -> None:
    from shards_schema.webdataset.convert import export_webdataset

    export_webdataset(_export.shards, d)


@pytest.mark.parametrize("case", list(REFUSED_OUTPUT_DIRS))
def test_a_refused_output_directory_is_left_exactly_as_it_was(case, example_jsonl, baseline, exported, tmp_path, capsys):
    """Every way these commands refuse an existing output directory (another job's output, files
    they did not write, a held lock, bad flags) leaves it as found: the same entries, sizes,
    modification times and bytes, and no lock file added."""
    from shards_schema.outdir import exclusive_output_dir

    make, argv, message, held = REFUSED_OUTPUT_DIRS[case]
    d = tmp_path / "D"
    parts = tmp_path / "parts"
    _export.shards = baseline[0]
    if "{parts}" in argv:
        for i in range(2):
            _run([example_jsonl], parts, workers=1, num_partitions=2, partition_index=i)
    if make is _job_dir:
        make(d, example_jsonl)
    else:
        make(d)
    paths = {"data": example_jsonl, "D": d, "shards": baseline[0], "tars": exported, "parts": parts,
             "shards_other": tmp_path / "other"}
    if "{shards_other}" in argv:
        _run([example_jsonl], tmp_path / "other", workers=1, rows_per_shard=4)
    argv, message = [a.format(**paths) for a in argv], message.format(**paths)
    with contextlib.ExitStack() as stack:
        if held:
            stack.enter_context(exclusive_output_dir(d, "preprocess"))
        before = _snapshot(d)
        code = vlmpack_exit_code(argv)
        after = _snapshot(d)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith(f"vlmpack {argv[0]}: error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err) and len([e for e in err if "error" in e]) == 1, err
    assert after == before


@pytest.mark.parametrize("case", ["made, nothing written", "made, a file written", "made, a file in a subdirectory",
                                  "there before"])
def test_a_job_that_fails_in_a_directory_it_made_before_writing_leaves_none(tmp_path, case):
    """A failed job removes the output directory it created, and the parents it made for it,
    only while that holds nothing but its lock file and empty directories; a directory that
    existed before, or holds a written file, stays."""
    from shards_schema.outdir import exclusive_output_dir

    d = tmp_path / "new" / "D"
    if case == "there before":
        d.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="refused"):
        with exclusive_output_dir(d, "train") as path:
            (path / "checkpoints" / "empty").mkdir(parents=True)
            if case == "made, a file written":
                (path / "metrics.jsonl").write_text("{}\n")
            elif case == "made, a file in a subdirectory":
                (path / "checkpoints" / "empty" / "x").write_text("x")
            raise RuntimeError("refused")
    if case == "made, nothing written":
        assert not (tmp_path / "new").exists() and tmp_path.is_dir()
    else:
        assert (d / "checkpoints" / "empty").is_dir()


def test_resume_refuses_an_input_edited_in_place(tmp_path):
    """Same size, same row count, other text: the old shards must not be kept as `already done`."""
    rows = example_rows(6, seed=5, size_range=(32, 64))
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    _run([data], out, workers=1, rows_per_shard=3)
    text = data.read_text(encoding="utf-8")
    first = rows[0]["messages"][-1]["content"]
    edited = text.replace(first, first[::-1], 1)
    assert edited != text and len(edited.encode()) == len(text.encode())
    stat = data.stat()
    data.write_text(edited, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"input {data} (was modified|changed) since .*new --out.*delete"):
        _run([data], out, workers=1, rows_per_shard=3)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old timestamp: the content differs
    with pytest.raises(ConfigError, match=rf"input {data} changed since"):
        _run([data], out, workers=1, rows_per_shard=3)
    data.write_text(text, encoding="utf-8")  # back to the original content, new timestamp: sampled mode refuses
    with pytest.raises(ConfigError, match=rf"input {data} was modified since .*modification time changed"):
        _run([data], out, workers=1, rows_per_shard=3)
    with pytest.raises(ConfigError, match="started with --input-hash sampled"):
        _run([data], out, workers=1, rows_per_shard=3, input_hash="full")
    job_file = out / "_parts" / "job.json"  # as an earlier vlmpack wrote it: no fingerprints
    recorded = json.loads(job_file.read_text())
    for inp in recorded["inputs"]:
        del inp["fingerprint"]
    job_file.write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="earlier vlmpack that recorded no input fingerprints"):
        _run([data], out, workers=1, rows_per_shard=3)


@pytest.mark.parametrize("change", ["cut", "append", "edit"])
def test_an_input_changed_while_the_job_reads_it_stops_the_job_without_a_manifest(tmp_path, monkeypatch, capsys,
                                                                                   change):
    """A file still being written (or cut, or edited in place) while its units are read: the
    shards hold rows of neither version whole. One line, exit 2, no manifest; the same
    directory is then refused as another job's input."""
    from preprocess.job import local

    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(6, seed=5, size_range=(32, 64)))
    lines = data.read_bytes().splitlines(keepends=True)
    process_unit = local.process_unit

    def change_then_process(unit, *args, **kwargs):
        if unit.index == 1:  # after the first unit committed
            if change == "cut":
                data.write_bytes(b"".join(lines[:4]))
            elif change == "append":
                with open(data, "ab") as fh:
                    fh.write(lines[0])
            else:
                data.write_bytes(b"".join(lines).replace(b'"user"', b'"usr!"', 1))
        return process_unit(unit, *args, **kwargs)

    monkeypatch.setattr(local, "process_unit", change_then_process)
    out = tmp_path / "out"
    argv = ["preprocess", str(data), "--out", str(out), "--workers", "1", "--rows-per-shard", "3", "--no-progress"]
    assert vlmpack_exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"vlmpack preprocess: error: input {data} changed while the job read it")
    assert "no manifest is written" in err and f"delete {out} to start over" in err
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(local, "process_unit", process_unit)
    with pytest.raises(ConfigError, match=rf"input {data} (was modified|changed) since"):
        _run([data], out, workers=1, rows_per_shard=3)


@pytest.mark.parametrize("started, resumed", [("auto", "openai"), ("auto", "swift"), ("openai", "auto"),
                                               ("sharegpt", "swift")])
def test_resume_with_another_input_format_names_the_flag_not_the_input(tmp_path, started, resumed):
    """The input is untouched; only --input-format reads it in another layout. The refusal says
    so and names the layout to resume with, instead of claiming the input changed."""
    row = {"id": "g", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
    data = write_jsonl(tmp_path / "rows.jsonl", [row])
    out = tmp_path / "out"
    _run([data], out, workers=1, input_format=started)
    recorded = "sharegpt" if started == "auto" else started
    now = "sharegpt" if resumed == "auto" else resumed
    with pytest.raises(ConfigError) as err:
        _run([data], out, workers=1, input_format=resumed)
    assert "changed since" not in str(err.value)
    assert (f"was started reading input {data} as {recorded} rows, this run reads them as {now} (--input-format): "
            f"re-run with --input-format {recorded}") in str(err.value)
    _run([data], out, workers=1, input_format=recorded)  # the recorded layout resumes it


def test_full_input_hash_sees_an_edit_that_sampled_blocks_miss(tmp_path):
    """A 2 MiB input edited between sampled blocks, timestamp restored: only --input-hash full sees it."""
    good = json.dumps(_chat(text="What is this?"))
    filler = json.dumps({"padding": "x" * (2 << 20)})  # a row that is rejected cheaply
    data = tmp_path / "big.jsonl"
    data.write_text(f"{good}\n{filler}\n{good}\n")
    size, stat = data.stat().st_size, data.stat()
    between = (size - 64 * 1024) // 15 + 64 * 1024 + 100  # after the second sampled block ends
    for mode in ("sampled", "full"):
        out = tmp_path / mode
        _run([data], out, workers=1, rows_per_shard=2, input_hash=mode)
        with open(data, "r+b") as fh:
            fh.seek(between)
            fh.write(b"y" if mode == "sampled" else b"z")
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        if mode == "sampled":
            assert _run([data], out, workers=1, rows_per_shard=2, input_hash=mode)["_run"]["units_resumed"] == 2
        else:
            with pytest.raises(ConfigError, match=rf"input {data} changed since"):
                _run([data], out, workers=1, rows_per_shard=2, input_hash=mode)
        assert data.stat().st_size == size


def test_resume_redoes_a_deleted_or_damaged_shard(example_jsonl, baseline, tmp_path):
    from shards_schema.verify import verify_shards

    out = tmp_path / "out"
    _run([example_jsonl], out, workers=1)
    (out / "shard-000001.arrow").unlink()
    damaged = bytearray((out / "shard-000002.arrow").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (out / "shard-000002.arrow").write_bytes(bytes(damaged))
    manifest = _run([example_jsonl], out, workers=1)
    assert _shard_bytes(out) == _shard_bytes(baseline[0])
    report = verify_shards(out)
    assert report.ok, report.faults
    assert _without_run(manifest) == _without_run(baseline[1])
    assert manifest["_run"]["units_redone"] == [1, 2] and manifest["_run"]["units_done_now"] == 2


def test_the_same_file_spelled_differently_is_one_job(tmp_path, monkeypatch):
    rows = example_rows(4, seed=2, size_range=(32, 64))
    (tmp_path / "work").mkdir()
    write_jsonl(tmp_path / "work" / "rows.jsonl", rows)
    monkeypatch.chdir(tmp_path / "work")
    first = _run(["rows.jsonl"], "out", workers=1, rows_per_shard=2)
    assert first["accounting"]["inputs"][0]["path"] == "rows.jsonl"
    for spelling in ("./rows.jsonl", str(tmp_path / "work" / "rows.jsonl"), "../work/rows.jsonl"):
        again = _run([spelling], "out", workers=1, rows_per_shard=2)
        assert again["_run"]["units_resumed"] == 2 and _without_run(again) == _without_run(first), spelling
    monkeypatch.chdir(tmp_path)  # from elsewhere: the same file keeps the name the job started with
    again = _run(["work/rows.jsonl"], "work/out", workers=1, rows_per_shard=2)
    assert again["_run"]["units_resumed"] == 2 and _without_run(again) == _without_run(first)
    assert open_shards(tmp_path / "work" / "out")[0]["source"] == "rows.jsonl:0"


def test_undecodable_file_names_and_surrogates_never_stop_the_job(tmp_path, monkeypatch):
    """A file name that is not UTF-8, an id holding a lone surrogate, and whatever a row's
    processing raises or returns: each becomes a reject or an escaped name, never a crash."""
    import preprocess.job.units as job  # where a unit's rows are processed

    rows = example_rows(5, seed=4, size_range=(32, 64))
    rows[1]["id"] = "\ud800"
    rows[2]["id"] = "raise-me"
    rows[3]["id"] = "odd-uid"
    data = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.jsonl"))
    with open(data, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")  # ensure_ascii: the surrogate is a valid \ud800 escape
    real_process_row = job.process_row

    def odd_process_row(row, **kw):
        if row.get("id") == "raise-me":
            raise ValueError("broken on \udcff")
        sample = real_process_row(row, **kw)
        if row.get("id") == "odd-uid":
            sample = dataclasses.replace(sample, sample_uid="odd\udc80uid")
        return sample

    monkeypatch.setattr(job, "process_row", odd_process_row)
    media = Path(os.fsdecode(bytes(tmp_path) + b"/m\xe9dia"))
    media.mkdir()
    out = tmp_path / "out"
    for _ in range(2):  # the re-run resumes as well
        manifest = _run([data], out, workers=1, rows_per_shard=2, sample=SampleOptions(media_root=str(media)))
    name = str(tmp_path) + "/caf\\xe9.jsonl"
    assert manifest["accounting"]["inputs"][0]["path"] == name
    assert manifest["settings"]["media_root"] == str(tmp_path) + "/m\\xe9dia"
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["row"]: r["code"] for r in rejects} == {1: "bad_id", 2: "internal_error", 3: "internal_error"}
    assert "ValueError: broken on \\udcff" in rejects[1]["reason"] and "UnicodeEncodeError" in rejects[2]["reason"]
    assert all(r["source"] == name for r in rejects)
    assert [open_shards(out)[i]["source"] for i in range(2)] == [f"{name}:0", f"{name}:4"]
    json.loads((out / "manifest.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- arguments and outcomes


BAD_ARGUMENTS = [
    ("preprocess", ["--workers", "0"], "--workers must be an integer from 1 to 4096, got 0"),
    ("preprocess", ["--workers", "-3"], "--workers must be an integer from 1 to 4096, got -3"),
    ("preprocess", ["--max-seq-len", "0"], "--max-seq-len must be an integer from 1 to 2147483647, got 0"),
    ("preprocess", ["--max-seq-len", str(10**20)], f"--max-seq-len must be an integer from 1 to 2147483647, got {10**20}"),
    ("preprocess", ["--rows-per-shard", "0"], "--rows-per-shard must be an integer >= 1, got 0"),
    ("preprocess", ["--num-partitions", "0"], "--num-partitions must be an integer >= 1, got 0"),
    ("preprocess", ["--num-partitions", "2", "--partition-index", "2"], "--partition-index must be in 0..1"),
    ("preprocess", ["--max-image-pixels", "0"], "--max-image-pixels must be an integer >= 1"),
    ("preprocess", ["--min-pixels", "-1"], "--min-pixels must be an integer >= 1"),
    ("preprocess", ["--media-root", "{tmp}/nowhere"], "--media-root {tmp}/nowhere is not a directory"),
    ("preprocess", ["--profile", "llava"], "unknown profile"),
    ("preprocess", ["--remote-timeout", "0"], "--remote-timeout: must be a positive, finite number of seconds, got 0"),
    ("preprocess", ["--remote-timeout", "inf"], "--remote-timeout: must be a positive, finite number of seconds"),
    ("preprocess", ["--remote-retries", "11"], "--remote-retries: must be an integer from 0 to 10, got 11"),
    ("preprocess", ["--remote-retries", "-1"], "--remote-retries: must be an integer from 0 to 10, got -1"),
    ("preprocess", ["--video-fps", "0.0001"], "--video-fps: must be a finite number of at least 0.001, got 0.0001"),
    ("preprocess", ["--video-total-pixels", str(10**20)], "--video-total-pixels: must be a positive integer, at most 2**53"),
    ("preprocess", ["--min-pixels", str(2**53 + 1)], f"--min-pixels must be at most 2**53 ({2**53}), got {2**53 + 1}"),
    ("preprocess-missing", [], "input {tmp}/missing.jsonl does not exist"),
    ("preprocess-glob", [], "input {tmp}/nomatch/*.jsonl matches no file: the pattern reached vlmpack unexpanded"),
    ("preprocess-empty", [], "an input is given as an empty string (''): give its path"),
    ("preprocess-out-file", [], "--out {tmp}/afile is a file, not a directory"),
    ("merge", ["{tmp}/nowhere", "--out", "{tmp}/m"], "{tmp}/nowhere does not exist or is not a directory"),
    ("merge", ["{tmp}", "--out", "{tmp}/m"], "not the output of `vlmpack preprocess`"),
    # a file system that connects as it is made: the failure is the store's, not a traceback
    ("merge", ["ftp://no-such-host.invalid/x", "--out", "{tmp}/m"], "ftp://no-such-host.invalid/x/_parts/job.json: "
                                                                    "cannot reach the store ("),
    ("inspect", ["{tmp}/line\nbreak"], "{tmp}/line\\nbreak: no manifest.json"),
    ("quickstart", ["--rows", "0"], "--rows must be an integer from 1 to 1000, got 0"),
    ("quickstart", ["--videos", "-1"], "--videos must be an integer from 0 to 100, got -1"),
    ("quickstart", ["--workers", "0"], "--workers must be an integer from 1 to 4096, got 0"),
    ("quickstart", ["--workers", "4097"], "--workers must be an integer from 1 to 4096, got 4097"),
    ("quickstart", ["--out", "{tmp}/afile"], "--out {tmp}/afile is a file, not a directory"),
]


@pytest.mark.parametrize("command, argv, message", BAD_ARGUMENTS, ids=[f"{c}{' '.join(a)}" for c, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_one_line(command, argv, message, example_jsonl, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    message = message.replace("{tmp}", str(tmp_path))
    if command.startswith("preprocess"):
        data = {"preprocess-missing": tmp_path / "missing.jsonl", "preprocess-glob": f"{tmp_path}/nomatch/*.jsonl",
                "preprocess-empty": ""}.get(command, example_jsonl)
        out = tmp_path / "afile" if command == "preprocess-out-file" else tmp_path / "o"
        argv = ["preprocess", data, "--out", out, "--no-progress", *argv]
    elif command == "quickstart" and "--out" not in argv:
        argv = ["quickstart", "--out", tmp_path / "qs", *argv]
    else:
        argv = [command, *argv]
    (tmp_path / "line\nbreak").mkdir(exist_ok=True)
    code, err = _cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith(f"vlmpack {argv[0]}: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "m").exists() and not (tmp_path / "qs").exists()


EMPTY_VALUES = [
    ("preprocess", ["{data}", "--out", "{e}"], "--out"),
    *[("preprocess", ["{data}", "--out", "{o}", flag, "{e}"], flag)
      for flag in ("--model", "--profile", "--media-root", "--stage-dir", "--ray-address")],
    ("merge", ["{shards}", "--out", "{e}"], "--out"),
    ("merge", ["{e}", "--out", "{o}"], "a partition directory"),
    ("quickstart", ["--out", "{e}"], "--out"),
    ("export", ["{shards}", "--out", "{e}"], "--out"),
    ("export", ["{e}", "--out", "{o}"], "the shard directory"),
    ("import", ["{o}", "--out", "{e}"], "--out"),
    ("import", ["{e}", "--out", "{o}"], "the export directory"),
]


@pytest.mark.parametrize("command, argv, flag", EMPTY_VALUES, ids=[f"{c} {f}" for c, _, f in EMPTY_VALUES])
def test_an_empty_path_or_name_is_refused_not_read_as_the_current_directory(command, argv, flag, example_jsonl,
                                                                             baseline, tmp_path, capsys, monkeypatch):
    """`--out "$OUT"` with OUT unset: an empty string would be the current directory (written
    into), or for --model / --profile / --stage-dir no value at all (the default profile, used
    without a word). Refused in one line, nothing written anywhere."""
    empty = random.Random(f"{command} {flag}").choice(["", " ", "\t"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    paths = {"data": example_jsonl, "shards": baseline[0], "o": tmp_path / "o", "e": empty}
    extra = ["--no-progress"] if command == "preprocess" else []
    code, err = _cli(capsys, command, *[a.format(**paths) for a in argv], *extra)
    assert code == 2, err
    assert err.startswith(f"vlmpack {command}: error: {flag} is given as an empty string ({empty!r}): "), err
    assert err.count("\n") == 1, err
    assert not list(cwd.iterdir()) and not (tmp_path / "o").exists()


SCHEME_WITHOUT_SLASHES = [
    ("preprocess", ["{data}", "--out", "s3:/bucket/shards"], "--out", "s3://bucket/shards"),
    ("preprocess", ["gs:bkt/rows.jsonl", "--out", "{o}"], "an input", "gs://bkt/rows.jsonl"),
    ("preprocess", ["{data}", "--out", "{o}", "--stage-dir", "S3:/tmp/stage"], "--stage-dir", "S3://tmp/stage"),
    ("merge", ["{shards}", "--out", "hf:datasets/org/name"], "--out", "hf://datasets/org/name"),
    ("merge", ["s3:bucket/part0", "--out", "{o}"], "a partition directory", "s3://bucket/part0"),
    ("quickstart", ["--out", "gcs:/b/q"], "--out", "gcs://b/q"),
    ("export", ["{shards}", "--out", "s3a:/b/tars"], "--out", "s3a://b/tars"),
    ("import", ["https:/host/tars", "--out", "{o}"], "the export directory", "https://host/tars"),
    ("fetch", ["s3:/b/shards", "{o}"], "the source", "s3://b/shards"),
    ("fetch", ["{shards}", "gs:/b/copy"], "the destination", "gs://b/copy"),
]


@pytest.mark.parametrize("command, argv, flag, url", SCHEME_WITHOUT_SLASHES,
                         ids=[f"{c} {f}" for c, _, f, _ in SCHEME_WITHOUT_SLASHES])
def test_a_store_url_missing_its_slashes_is_refused_not_read_as_a_local_directory(command, argv, flag, url,
                                                                                  example_jsonl, baseline, tmp_path,
                                                                                  capsys, monkeypatch):
    """`--out s3:/bucket` (one slash) would write into a local directory named `s3:`; refused in
    one line that gives the URL as meant, nothing written anywhere."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    paths = {"data": example_jsonl, "shards": baseline[0], "o": tmp_path / "o"}
    extra = ["--no-progress"] if command == "preprocess" else []
    code, err = _cli(capsys, command, *[a.format(**paths) for a in argv], *extra)
    assert code == 2, err
    assert err.startswith(f"vlmpack {command}: error: {flag} ") and err.count("\n") == 1, err
    assert "is not a URL" in err and f"write {url}, with two slashes" in err, err
    assert not list(cwd.iterdir()) and not (tmp_path / "o").exists()


def test_a_local_path_that_looks_like_a_store_url_missing_its_slashes_is_taken_where_it_exists(tmp_path, monkeypatch):
    """Only a path that does not exist is refused: a directory really named `s3:` keeps working,
    and neither a drive letter (`C:/`) nor an unknown scheme counts as a store."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "bucket").mkdir(parents=True)
    for spec in ("s3:/bucket", "s3://bucket", "C:/data", "notastore:/x", "file:/x", "plain/dir", None):
        storage.refuse_malformed_url("--out", spec)
    with pytest.raises(UserError, match="write s3://other"):
        storage.refuse_malformed_url("--out", "s3:/other")


def test_an_unknown_command_exits_2_with_one_line_naming_the_commands(capsys):
    code, err = _cli(capsys, "frobnicate", "--out", "x")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("vlmpack: error: unknown command 'frobnicate': choose one of quickstart, preprocess, "), err


def test_no_command_exits_2_with_one_line_naming_the_commands_and_help_exits_0(capsys):
    code, err = _cli(capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("vlmpack: error: no command given: choose one of quickstart, preprocess, "), err
    from shards_schema.cli import main

    assert main(["--help"]) == 0 and "`vlmpack <command> --help` describes" in capsys.readouterr().out


# Numeric extremes in every numeric flag of these commands: each value either works (exit 0) or
# exits 2 with one line naming the flag. command -> (its command line before the flag, [(flag,
# the type it takes, which values it accepts)]); {data}: an input with an image and a video row,
# {shards}: a finished shard directory of ROWS samples, {o}: a new output directory.
EXTREME_VALUES = (str(10**30), "1e30", "1e-30", "inf", "-inf", "nan", "-1", "0")
NUMERIC_FLAGS = {
    "preprocess": (["preprocess", "{data}", "--out", "{o}", "--workers", "1", "--no-progress"], [
        ("--min-pixels", int, lambda v: 1 <= v <= 16777216),  # at most the profile's max_pixels
        ("--max-pixels", int, lambda v: 65536 <= v <= 2**53),  # at least the profile's min_pixels
        ("--max-seq-len", int, lambda v: 1 <= v <= 2**31 - 1),  # token positions are int32
        ("--max-image-pixels", int, lambda v: v >= 1),
        ("--max-media-bytes", int, lambda v: v >= 1),
        ("--video-fps", float, lambda v: v >= 0.001),
        ("--video-max-frames", int, lambda v: 2 <= v <= 2**53),
        ("--video-max-pixels", int, lambda v: 1 <= v <= 2**53),
        ("--video-total-pixels", int, lambda v: 1 <= v <= 2**53),
        ("--max-video-bytes", int, lambda v: v >= 1),
        ("--workers", int, lambda v: 1 <= v <= 4096),
        ("--rows-per-shard", int, lambda v: v >= 1),
        ("--num-partitions", int, lambda v: v == 1),  # more partitions need --partition-index too
        ("--partition-index", int, lambda v: False),  # only with --num-partitions
        ("--ray-max-retries", int, lambda v: False),  # only with --executor ray
    ]),
    "quickstart": (["quickstart", "--out", "{o}", "--rows", "2", "--videos", "0", "--workers", "1"], [
        ("--rows", int, lambda v: 1 <= v <= 1000),
        ("--videos", int, lambda v: 0 <= v <= 100),
        ("--workers", int, lambda v: 1 <= v <= 4096),  # checked as given, as preprocess checks it
    ]),
    "show": (["show", "{shards}"], [("--index", int, lambda v: -(ROWS + 2 - 2) <= v < ROWS)]),
    "verify": (["verify", "{shards}"], [("--max-faults", int, lambda v: v >= 0), ("--workers", int, lambda v: v >= 1)]),
    "export": (["export", "{shards}", "--out", "{o}"], [("--samples-per-tar", int, lambda v: v >= 1),
                                                         ("--max-tar-bytes", int, lambda v: v >= 1)]),
    "pack": (["pack", "{shards}", "--seq-len", "16384"], [
        ("--seq-len", int, lambda v: 16384 <= v < 2**31),  # no shorter than the longest sample
        ("--max-visual-tokens", int, lambda v: 16384 <= v < 2**31),
        ("--pad-to-multiple", int, lambda v: 1 <= v <= 16384),
        ("--seed", int, lambda v: v >= 0),
        ("--epoch", int, lambda v: v >= 0),
        ("--dp-size", int, lambda v: v == 1),  # a global batch of more packs than the data make is refused
        ("--global-batch-packs", int, lambda v: v == 1),
    ]),
}


def _accepts(kind, accepts, text: str) -> bool:
    try:
        value = kind(text)
    except ValueError:
        return False
    return math.isfinite(value) and accepts(value)


NUMERIC_EXTREMES = [(command, flag, text, _accepts(kind, accepts, text))
                    for command, (_, flags) in NUMERIC_FLAGS.items() for flag, kind, accepts in flags
                    for text in EXTREME_VALUES]


@pytest.fixture(scope="module")
def image_and_video_jsonl(tmp_path_factory):
    from preprocess.examples import video_example_rows

    rows = example_rows(1, seed=3, size_range=(32, 64)) + video_example_rows(2, seed=4)[1:]  # a video beside an image
    return write_jsonl(tmp_path_factory.mktemp("extremes") / "rows.jsonl", rows)


@pytest.mark.parametrize("command, flag, text, works", NUMERIC_EXTREMES,
                         ids=[f"{c} {f} {t}" for c, f, t, _ in NUMERIC_EXTREMES])
def test_numeric_extremes_work_or_exit_2_naming_the_flag(command, flag, text, works, image_and_video_jsonl, baseline,
                                                         tmp_path, capsys):
    base, _ = NUMERIC_FLAGS[command]
    paths = {"data": image_and_video_jsonl, "shards": baseline[0], "o": tmp_path / "o"}
    argv = [a.format(**paths) for a in base] + [f"{flag}={text}"]  # `=`: argparse would take -1 or -inf for a flag
    code = vlmpack_exit_code(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line
           and "row/s]" not in line and "B/s]" not in line and "shard/s]" not in line]
    assert not any("Traceback" in line for line in err), err
    if works:
        assert code == 0, err
    else:
        assert code == 2 and len(err) == 1 and err[0].startswith(f"vlmpack {command}: error: ") and flag in err[0], err


def test_nothing_written_warns_and_exits_1_with_rows_accounted_for(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _cli(capsys, "preprocess", empty, "--out", tmp_path / "a", "--workers", "1", "--no-progress")
    assert code == 1 and "warning: nothing written: 0 rows read, the inputs hold no rows" in err
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(3, seed=1, size_range=(32, 64)))
    code, err = _cli(capsys, "preprocess", data, "--out", tmp_path / "b", "--max-seq-len", "8", "--workers", "1", "--no-progress")
    assert code == 1 and f"nothing written: 3 rows read, all rejected (see {tmp_path / 'b'}/rejects.jsonl)" in err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["accounting"]["rows_rejected"] == 3 and manifest["accounting"]["rejects_by_reason"] == {"too_long": 3}
    assert len((tmp_path / "b" / "rejects.jsonl").read_text().splitlines()) == 3
