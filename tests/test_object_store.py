"""Object stores against a real S3 API served locally (moto's server, reached over HTTP by
s3fs exactly as AWS would be): inputs and media read from s3:// and from pre-signed https://
URLs, names recorded without their credentials, a missing or unreachable bucket named in one
line, media fetched only when the job opts in, and `vlmpack fetch` bringing a shard directory
down checked against its manifest, resuming, and refusing a damaged shard."""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from preprocess.examples import example_rows, synthetic_image, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions
from shards_schema import open_shards
from shards_schema.storage import classify, redact

pytest.importorskip("moto", reason="the test extra: moto's S3 server")
pytest.importorskip("s3fs", reason="the test extra: s3fs")

ENV = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
       "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """A local S3 endpoint; the standard environment variables point the clients at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, FSSPEC_S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint)
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="data")
    yield client, endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _image_png(seed: int) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    synthetic_image(np.random.default_rng(seed), 96, 64).save(buf, format="PNG")
    return buf.getvalue()


def _rows_with_urls(urls: list[str]) -> list[dict]:
    return [{"id": f"r{k}", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A picture."}]} for k, url in enumerate(urls)]


def _outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".vlmpack.lock"}



def cut_uploads_after(monkeypatch, uploads: int):
    """Every upload after the first `uploads` fails as a reset connection would. Returns the real
    upload function and the list of URLs uploaded."""
    import shards_schema.storage as storage_module

    real_upload, calls = storage_module.upload_file, []

    def cut(path, url):
        if len(calls) == uploads:
            raise storage_module.StorageError("unreachable", f"{url}: connection reset (injected)")
        calls.append(url)
        real_upload(path, url)

    monkeypatch.setattr(storage_module, "upload_file", cut)
    return real_upload, calls

def test_inputs_from_s3_equal_the_same_files_on_disk(s3, tmp_path):
    client, _ = s3
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(20, seed=4, size_range=(32, 128), include_bad_rows=True))
    client.upload_file(str(data), "data", "in/rows.jsonl")
    remote = run_preprocess(PreprocessConfig(inputs=["s3://data/in/rows.jsonl"], out=str(tmp_path / "remote"),
                                             workers=2, rows_per_shard=8, progress=False))
    local = run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "local"), workers=1,
                                            rows_per_shard=8, progress=False))
    assert remote["accounting"]["inputs"][0]["path"] == "s3://data/in/rows.jsonl"
    assert remote["accounting"]["inputs"][0]["fingerprint"] == local["accounting"]["inputs"][0]["fingerprint"]
    a, b = open_shards(tmp_path / "remote"), open_shards(tmp_path / "local")
    assert len(a) == len(b) == 20
    for i in range(len(a)):  # the same samples; only `source` names the input differently
        assert a[i]["source"] == b[i]["source"].replace(str(data), "s3://data/in/rows.jsonl")
        for key in ("input_ids", "loss_mask", "position_ids", "pixel_patches", "image_grid_thw"):
            assert (a[i][key] == b[i][key]).all(), key


def test_media_from_s3_and_presigned_urls_only_when_allowed_and_never_recording_credentials(s3, tmp_path):
    client, _ = s3
    client.put_object(Bucket="data", Key="img/a.png", Body=_image_png(1))
    presigned = client.generate_presigned_url("get_object", Params={"Bucket": "data", "Key": "img/a.png"}, ExpiresIn=600)
    assert "Signature=" in presigned
    urls = ["s3://data/img/a.png", presigned, "s3://data/img/missing.png", "s3://no-such-bucket/a.png"]
    rows = write_jsonl(tmp_path / "rows.jsonl", _rows_with_urls(urls))
    client.upload_file(str(rows), "data", "in/media.jsonl")
    signed_input = client.generate_presigned_url("get_object", Params={"Bucket": "data", "Key": "in/media.jsonl"},
                                                 ExpiresIn=600)
    off = run_preprocess(PreprocessConfig(inputs=[str(rows)], out=str(tmp_path / "off"), workers=1, progress=False))
    assert off["accounting"]["rejects_by_reason"] == {"remote_url": 4}
    on = run_preprocess(PreprocessConfig(inputs=[signed_input], out=str(tmp_path / "on"), workers=1, progress=False,
                                         sample=SampleOptions(allow_remote_media=True)))
    assert on["accounting"]["rows_written"] == 2
    assert on["accounting"]["rejects_by_reason"] == {"remote_not_found": 2}
    recorded = "".join(p.read_text() for p in (tmp_path / "on").rglob("*.json*"))
    for secret in ("Signature", "Credential", ENV["AWS_ACCESS_KEY_ID"], ENV["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in recorded, secret
    assert on["accounting"]["inputs"][0]["path"] == redact(signed_input)
    assert "Signature" not in redact(signed_input) and "AccessKeyId" not in redact(signed_input)
    shards = open_shards(tmp_path / "on")
    assert shards[0]["pixel_patches"].tobytes() == shards[1]["pixel_patches"].tobytes()  # the same image both ways
    inline = write_jsonl(tmp_path / "inline.jsonl", _rows_with_urls(["data:image/png;base64," + base64.b64encode(
        _image_png(1)).decode()]))
    run_preprocess(PreprocessConfig(inputs=[str(inline)], out=str(tmp_path / "inline"), workers=1, progress=False))
    assert open_shards(tmp_path / "inline")[0]["pixel_patches"].tobytes() == shards[0]["pixel_patches"].tobytes()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case", ["no_bucket", "no_object", "unreachable"])
def test_an_input_that_cannot_be_read_is_one_line_exit_2(case, s3, tmp_path):
    _, endpoint = s3
    url = {"no_bucket": "s3://no-such-bucket/rows.jsonl", "no_object": "s3://data/nothing-here.jsonl",
           "unreachable": "s3://data/rows.jsonl"}[case]
    env = dict(os.environ)
    if case == "unreachable":
        env["FSSPEC_S3_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{_closed_port()}"
        env["AWS_MAX_ATTEMPTS"] = "1"
    done = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", url, "--out", str(tmp_path / "o"),
                           "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0], done.stderr
    assert {"no_bucket": "does not exist", "no_object": "does not exist", "unreachable": "cannot reach"}[case] in lines[0]


def _upload_dir(client, directory: Path, prefix: str) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != ".vlmpack.lock":
            client.upload_file(str(path), "data", f"{prefix}/{path.relative_to(directory).as_posix()}")


def test_fetch_checks_every_shard_resumes_and_refuses_a_damaged_one(s3, tmp_path):
    from shards_schema import verify_shards
    from shards_schema.fetch import FetchMismatch, fetch

    client, _ = s3
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(16, seed=9, size_range=(32, 96), include_bad_rows=True))
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "made"), workers=1, rows_per_shard=4,
                                    progress=False))
    _upload_dir(client, tmp_path / "made", "shards")
    done = fetch("s3://data/shards", tmp_path / "got", progress=False)
    assert done["fetched"] == len(json.loads((tmp_path / "made" / "manifest.json").read_text())["shards"]) > 2
    assert _outputs(tmp_path / "got") == {k: v for k, v in _outputs(tmp_path / "made").items()}
    assert verify_shards(tmp_path / "got").ok
    assert fetch("s3://data/shards", tmp_path / "got", progress=False)["up_to_date"]
    # an interrupted fetch: no manifest yet, one shard there, one torn; the re-run keeps the good one
    partial = tmp_path / "partial"
    partial.mkdir()
    names = sorted(p.name for p in (tmp_path / "made").glob("shard-*.arrow"))
    (partial / names[0]).write_bytes((tmp_path / "made" / names[0]).read_bytes())
    (partial / (names[1] + ".tmp")).write_bytes(b"torn")
    resumed = fetch("s3://data/shards", partial, progress=False)
    assert resumed["kept"] == 1 and resumed["fetched"] == len(names) - 1
    assert _outputs(partial) == _outputs(tmp_path / "made")
    # a shard in the store that does not match the manifest: exit 1, no manifest, nothing of it kept
    bad = bytearray((tmp_path / "made" / names[1]).read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket="data", Key=f"shards/{names[1]}", Body=bytes(bad))
    with pytest.raises(FetchMismatch, match="does not match the manifest"):
        fetch("s3://data/shards", tmp_path / "damaged", progress=False)
    assert not (tmp_path / "damaged" / "manifest.json").exists() and not (tmp_path / "damaged" / names[1]).exists()
    cli = subprocess.run([sys.executable, "-m", "shards_schema.cli", "fetch", "s3://data/shards", str(tmp_path / "d2"),
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1 and "the source is damaged" in cli.stderr


def test_ctrl_c_during_a_fetch_is_one_line_exit_130_and_the_rerun_fetches_the_rest(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a shard streams in: that shard's partial copy goes, the ones before it stay,
    and the same command again fetches the rest. Any other command stopped by Ctrl-C says so in
    one line too (exit 130)."""
    import shards_schema.fetch as fetch_module
    import shards_schema.verify as verify_module
    from shards_schema import verify_shards
    from shards_schema.cli import main

    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(12, seed=9, size_range=(32, 96)))
    made, got = tmp_path / "made", tmp_path / "got"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(made), workers=1, rows_per_shard=3, progress=False))
    real_copy, copied = fetch_module._copy, []

    class CtrlC:
        def update(self, n):
            raise KeyboardInterrupt

    def copy_then_ctrl_c(src_file, dst, expect_bytes, expect_sha256, bar):
        real_copy(src_file, dst, expect_bytes, expect_sha256, CtrlC() if len(copied) == 2 else bar)
        copied.append(dst.name)

    monkeypatch.setattr(fetch_module, "_copy", copy_then_ctrl_c)
    assert main(["fetch", str(made), str(got), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("vlmpack fetch: error: stopped by SIGINT (Ctrl-C); the shards fetched so far are kept")
    assert sorted(p.name for p in got.iterdir() if p.name != ".vlmpack.lock") == sorted(copied) and len(copied) == 2
    monkeypatch.setattr(fetch_module, "_copy", real_copy)
    assert main(["fetch", str(made), str(got), "--no-progress"]) == 0
    assert "kept 2 already there" in capsys.readouterr().out
    assert _outputs(got) == _outputs(made) and verify_shards(got).ok

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_module, "_verify_and_report", ctrl_c)
    assert main(["verify", str(got)]) == 130
    assert capsys.readouterr().err == "vlmpack verify: error: stopped by SIGINT (Ctrl-C) before it finished\n"


def test_fetch_into_a_finished_copy_checks_every_shard_and_fetches_a_damaged_one_again(s3, tmp_path, monkeypatch, capsys):
    """A re-run over a finished copy hashes each shard once (a shard fetched now is hashed as it
    streams in, never read again); a shard whose bytes changed, or that a FIFO replaced, fails the
    check and comes down again, the manifest written only when all of them are checked."""
    import shards_schema.fetch as fetch_module
    from shards_schema import verify_shards
    from shards_schema.cli import main

    client, _ = s3
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(12, seed=7, size_range=(32, 96)))
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "made"), workers=1, rows_per_shard=4,
                                    progress=False))
    _upload_dir(client, tmp_path / "made", "recheck")
    names = sorted(p.name for p in (tmp_path / "made").glob("shard-*.arrow"))
    hashed = []
    real_sha256 = fetch_module.file_sha256
    monkeypatch.setattr(fetch_module, "file_sha256", lambda path: hashed.append(Path(path).name) or real_sha256(path))
    got = tmp_path / "got"
    assert fetch_module.fetch("s3://data/recheck", got, progress=False)["fetched"] == len(names) == 3
    assert hashed == []  # hashed while streaming in: no second read
    again = fetch_module.fetch("s3://data/recheck", got, progress=False)
    assert again["up_to_date"] and sorted(hashed) == names  # each checked once, nothing downloaded
    flipped = bytearray((got / names[1]).read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # same size: only the sha256 tells
    (got / names[1]).write_bytes(bytes(flipped))
    (got / names[2]).unlink()
    os.mkfifo(got / names[2])  # checked by a stat, never opened
    done = fetch_module.fetch("s3://data/recheck", got, progress=False)
    assert not done["up_to_date"] and done["refetched"] == names[1:] and done["kept"] == 1
    assert _outputs(got) == _outputs(tmp_path / "made")
    assert main(["fetch", "s3://data/recheck", str(got), "--no-progress"]) == 0
    assert "already there, every shard checked against the manifest's sha256 (3 shards)" in capsys.readouterr().out
    (got / names[0]).write_bytes((got / names[0]).read_bytes()[:-1])
    assert main(["fetch", "s3://data/recheck", str(got), "--no-progress"]) == 0
    assert f"({names[0]} failed the check and came down again)" in capsys.readouterr().out
    assert _outputs(got) == _outputs(tmp_path / "made")
    assert verify_shards(got).ok


def test_fetch_refuses_a_source_manifest_it_cannot_check_against(s3, tmp_path, capsys):
    """An entry without a sha256 (or with a size that is no count) could not be checked: the
    fetch stops at once in one line naming the field, and writes nothing."""
    from shards_schema.cli import main

    client, _ = s3
    made = tmp_path / "made"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", example_rows(4, seed=3)))],
                                    out=str(made), workers=1, progress=False))
    manifest = json.loads((made / "manifest.json").read_text())
    for key, value in (("sha256", None), ("bytes", -1)):
        broken = json.loads(json.dumps(manifest))
        broken["shards"][0][key] = value
        (made / "manifest.json").write_text(json.dumps(broken))
        _upload_dir(client, made, f"unchecked-{key}")
        assert main(["fetch", f"s3://data/unchecked-{key}", str(tmp_path / key), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"s3://data/unchecked-{key}/manifest.json: shards[0]" in err and key in err, err
        assert not (tmp_path / key).exists() or not any((tmp_path / key).glob("*.arrow"))


@pytest.fixture(scope="module")
def locked_s3(tmp_path_factory):
    """A second S3 endpoint that checks credentials (moto's IAM enforcement): a bucket with an
    image and a rows file is made before checking starts; our keys are unknown to it."""
    port = _closed_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    import time

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for _ in range(200):
        try:
            client.create_bucket(Bucket="locked")
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    client.put_object(Bucket="locked", Key="a.png", Body=_image_png(2))
    client.put_object(Bucket="locked", Key="rows.jsonl", Body=b"{}\n")
    yield endpoint
    server.terminate()
    server.wait(timeout=30)


def test_denied_credentials_are_named_for_inputs_and_rejected_per_row_for_media(s3, locked_s3, tmp_path):
    env = {**os.environ, "FSSPEC_S3_ENDPOINT_URL": locked_s3, "AWS_ENDPOINT_URL": locked_s3}
    done = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", "s3://locked/rows.jsonl", "--out",
                           str(tmp_path / "o"), "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "s3://locked/rows.jsonl: access denied" in done.stderr and "credentials" in done.stderr
    rows = write_jsonl(tmp_path / "rows.jsonl", _rows_with_urls(["s3://locked/a.png"]) + example_rows(2, seed=1))
    done = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", str(rows), "--out", str(tmp_path / "m"),
                           "--allow-remote-media", "--workers", "1", "--no-progress"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    rejects = [json.loads(line) for line in (tmp_path / "m" / "rejects.jsonl").read_text().splitlines()]
    assert [r["code"] for r in rejects] == ["remote_denied"] and "access denied" in rejects[0]["reason"]
    assert ENV["AWS_SECRET_ACCESS_KEY"] not in (tmp_path / "m" / "rejects.jsonl").read_text()


def test_preprocess_into_the_store_publishes_last_resumes_a_cut_upload_and_verifies_remotely(s3, tmp_path, monkeypatch,
                                                                                             capsys):
    """--out s3://...: the job runs in a staging directory, then every file is uploaded and
    the manifest last. An upload cut after two objects leaves no manifest; the same command
    again resumes (all units already committed) and uploads the rest; an object of the wrong
    size left in the store is replaced. `verify` and `fetch` of the prefix give the local bytes."""
    import shards_schema.storage as storage_module
    from shards_schema.cli import main

    client, _ = s3
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(16, seed=21, size_range=(32, 96), include_bad_rows=True))
    local = run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "local"), workers=1, rows_per_shard=4,
                                            progress=False))
    names = sorted(p.name for p in (tmp_path / "local").glob("shard-*.arrow"))
    client.put_object(Bucket="data", Key=f"pub/{names[-1]}", Body=b"a partial upload by someone else")
    real_upload, calls = cut_uploads_after(monkeypatch, 2)
    argv = ["preprocess", str(data), "--out", "s3://data/pub", "--stage-dir", str(tmp_path / "stage"), "--workers", "1",
            "--rows-per-shard", "4", "--no-progress"]
    assert main(argv) == 2
    listed = {o["Key"] for o in client.list_objects_v2(Bucket="data", Prefix="pub/").get("Contents", [])}
    assert len(calls) == 2 and "pub/manifest.json" not in listed
    monkeypatch.setattr(storage_module, "upload_file", real_upload)
    manifest = run_preprocess(PreprocessConfig(inputs=[str(data)], out="s3://data/pub", stage_dir=str(tmp_path / "stage"),
                                               workers=1, rows_per_shard=4, progress=False))
    assert manifest["_run"]["units_done_now"] == 0  # every unit was committed in the stage
    assert manifest["_run"]["upload"]["kept"] >= 2
    local.pop("_run"), manifest.pop("_run")
    assert manifest == local
    got = tmp_path / "fetched"
    assert main(["fetch", "s3://data/pub", str(got), "--no-progress"]) == 0
    assert _outputs(got) == _outputs(tmp_path / "local")
    assert main(["verify", "s3://data/pub"]) == 0
    # the same command once more: nothing to upload
    again = run_preprocess(PreprocessConfig(inputs=[str(data)], out="s3://data/pub", stage_dir=str(tmp_path / "stage"),
                                            workers=1, rows_per_shard=4, progress=False))
    assert again["_run"]["upload"]["uploaded"] == 0
    # damaged in the store: `verify` of the prefix lists every fault, as of a local directory
    client.delete_object(Bucket="data", Key=f"pub/{names[0]}")
    client.put_object(Bucket="data", Key=f"pub/{names[1]}", Body=b"junk")
    client.put_object(Bucket="data", Key="pub/shard-999999.arrow", Body=b"stray")
    capsys.readouterr()
    assert main(["verify", "s3://data/pub", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    kinds = {fault["kind"] for fault in report["faults"]}
    assert {"missing_shard", "unlisted_shard"} <= kinds and len(kinds) >= 3, report
    assert "vlmpack-verify-" not in json.dumps(report) and "s3://data/pub" in json.dumps(report)


def _stages(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("vlmpack-stage-*"))


def test_a_store_prefix_holding_another_job_is_refused_before_the_first_row_naming_the_url(s3, tmp_path, monkeypatch,
                                                                                           capsys):
    """The destination is checked before any work: a prefix holding another dataset (or another
    job's unfinished upload, objects that no job writes, or, for a partition, any finished
    dataset) is refused in one line
    naming the URL, never a local staging directory; no row is processed, no stage is made.
    The same job again finds its dataset there and does nothing."""
    import preprocess.job.local as job  # where the local executor runs its units
    from shards_schema.cli import main

    client, _ = s3
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(6, seed=41, size_range=(32, 96)))
    common = ["--workers", "1", "--rows-per-shard", "4", "--no-progress"]
    assert main(["preprocess", str(data), "--out", "s3://data/taken", *common]) == 0
    capsys.readouterr()
    processed = []
    real_process_unit = job.process_unit
    monkeypatch.setattr(job, "process_unit", lambda *a, **k: processed.append(1) or real_process_unit(*a, **k))
    other_job = {"profile": {}, "settings": {}, "inputs": [], "num_partitions": 1}  # an upload cut short
    client.put_object(Bucket="data", Key="half/_parts/job.json", Body=json.dumps(other_job).encode())
    client.put_object(Bucket="data", Key="foreign/manifest.json", Body=b'["a list"]')
    client.put_object(Bucket="data", Key="stray/notes.txt", Body=b"someone's notes")
    client.put_object(Bucket="data", Key="stray/shard-000000.arrow", Body=b"a job's name, not a job's bytes")
    client.put_object(Bucket="data", Key="strayparts/_parts/their.db", Body=b"x")
    for out, extra, says in (
            ("s3://data/stray", [], "holds objects that no vlmpack job writes (notes.txt): choose a new or empty prefix"),
            ("s3://data/strayparts", [], "holds objects that no vlmpack job writes (_parts/their.db): choose a new or "
                                         "empty prefix"),
            ("s3://data/foreign", [], "s3://data/foreign/manifest.json: holds a JSON array, not an object: it is no "
                                      "vlmpack file; choose another --out prefix"),
            ("s3://data/taken", ["--max-seq-len", "999"], "holds another dataset (its manifest.json differs in: settings)"),
            ("s3://data/half", [], "holds the unfinished output of a different job (its _parts/job.json differs in: "),
            ("s3://data/taken", ["--num-partitions", "2", "--partition-index", "0"], "holds a finished dataset (manifest.json): a partition")):
        assert main(["preprocess", str(data), "--out", out, *common, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and (err.startswith(f"vlmpack preprocess: error: --out {out} {says}")
                                         or err == f"vlmpack preprocess: error: {says}\n"), err
        assert "vlmpack-stage" not in err and str(tmp_path) not in err
    assert processed == [] and _stages(tmp_path / "tmp") == []
    assert main(["preprocess", str(data), "--out", "s3://data/taken", *common]) == 0
    assert "upload:         nothing to do: s3://data/taken holds this job's dataset already" in capsys.readouterr().out
    assert processed == [] and _stages(tmp_path / "tmp") == []


def test_a_stage_dir_that_cannot_hold_the_job_is_named_as_the_stage_dir_and_s3a_is_s3(s3, tmp_path, capsys):
    """A --stage-dir that is a file or holds other files is refused naming --stage-dir (the
    job's --out is the store's); the same object spelled s3:// and s3a:// is one input named
    twice."""
    from shards_schema.cli import main

    client, _ = s3
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(4, seed=43, size_range=(32, 64)))
    client.upload_file(str(data), "data", "twice/rows.jsonl")
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("someone's notes")
    common = ["--out", "s3://data/staged", "--workers", "1", "--no-progress"]
    for stage, says in ((tmp_path / "a-file", f"--stage-dir {tmp_path / 'a-file'} is a file, not a directory"),
                        (tmp_path / "busy", f"--stage-dir {tmp_path / 'busy'} is not empty and holds no resumable job "
                                            "of `vlmpack preprocess` (it has notes.txt): choose a new or empty "
                                            "--stage-dir directory")):
        assert main(["preprocess", str(data), *common, "--stage-dir", str(stage)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert main(["preprocess", "s3://data/twice/rows.jsonl", "s3a://data/twice/rows.jsonl", "--out",
                 str(tmp_path / "out"), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "input s3a://data/twice/rows.jsonl is the same input as s3://data/twice/rows.jsonl: its rows would be read " \
        "twice" in err, err


def test_the_stage_is_the_jobs_own_and_goes_once_its_upload_is_complete(s3, tmp_path, monkeypatch):
    """The default stage is named after the destination and the job: an upload cut short
    resumes from it (no unit redone), a complete upload removes it, and a later, different job
    to the same prefix (its old dataset deleted from the store) is not refused by a stale stage."""
    import shards_schema.storage as storage_module
    from shards_schema.cli import main

    client, _ = s3
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    first = write_jsonl(tmp_path / "first.jsonl", example_rows(6, seed=51, size_range=(32, 96)))
    second = write_jsonl(tmp_path / "second.jsonl", example_rows(5, seed=52, size_range=(32, 96)))
    real_upload, calls = cut_uploads_after(monkeypatch, 2)
    argv = ["--out", "s3://data/reused", "--workers", "1", "--rows-per-shard", "4", "--no-progress"]
    assert main(["preprocess", str(first), *argv]) == 2
    (stage,) = _stages(tmp_path / "tmp")  # kept: the upload is not complete
    monkeypatch.setattr(storage_module, "upload_file", real_upload)
    resumed = run_preprocess(PreprocessConfig(inputs=[str(first)], out="s3://data/reused", workers=1, rows_per_shard=4,
                                              progress=False))
    assert resumed["_run"]["units_done_now"] == 0 and resumed["_run"]["stage"] == str(tmp_path / "tmp" / stage)
    assert _stages(tmp_path / "tmp") == []
    client.delete_objects(Bucket="data", Delete={"Objects": [
        {"Key": o["Key"]} for o in client.list_objects_v2(Bucket="data", Prefix="reused/")["Contents"]]})
    assert main(["preprocess", str(second), *argv]) == 0  # new inputs, same prefix
    assert _stages(tmp_path / "tmp") == []
    got = tmp_path / "got"
    assert main(["fetch", "s3://data/reused", str(got), "--no-progress"]) == 0
    assert len(open_shards(got)) == 5


def test_partitions_into_the_store_then_merge_from_it_equal_one_job(s3, tmp_path, monkeypatch):
    """Each partition publishes its directory (no manifest) to its own prefix; `merge` of the
    prefixes into a store prefix gives one local job's dataset; the stages live under a
    temporary directory of the test's own, and every one of them is gone at the end (a merge
    run again finds the dataset published and does nothing)."""
    from shards_schema.cli import main

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(14, seed=33, size_range=(32, 96), include_bad_rows=True))
    local = run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "local"), workers=1, rows_per_shard=4,
                                            progress=False))
    for i in range(3):
        assert main(["preprocess", str(data), "--out", f"s3://data/parts/p{i}", "--num-partitions", "3",
                     "--partition-index", str(i), "--workers", "1", "--rows-per-shard", "4", "--no-progress"]) == 0
    client, _ = s3
    listed = {o["Key"] for o in client.list_objects_v2(Bucket="data", Prefix="parts/").get("Contents", [])}
    assert not any(k.endswith("manifest.json") for k in listed) and any("partition-0-of-3" in k for k in listed)
    again = run_preprocess(PreprocessConfig(inputs=[str(data)], out="s3://data/parts/p1", num_partitions=3,
                                            partition_index=1, workers=1, rows_per_shard=4, progress=False))
    assert again["_run"]["units_done_now"] == 0 and again["_run"]["stage"] is None  # published whole: nothing redone
    assert main(["merge", *(f"s3://data/parts/p{i}" for i in range(3)), "--out", "s3://data/merged"]) == 0
    assert main(["fetch", "s3://data/merged", str(tmp_path / "got"), "--no-progress"]) == 0
    assert _outputs(tmp_path / "got") == _outputs(tmp_path / "local")
    local.pop("_run")
    assert json.loads((tmp_path / "got" / "manifest.json").read_text()) == local
    assert _stages(tmp_path / "tmp") == []  # the partitions', the merged and the sources' stages all went
    assert main(["merge", *(f"s3://data/parts/p{i}" for i in range(3)), "--out", "s3://data/merged"]) == 0
    assert _stages(tmp_path / "tmp") == []


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory) -> str:
    """manifest.json of a small real shard directory."""
    root = tmp_path_factory.mktemp("small")
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(root / "rows.jsonl", example_rows(2, seed=1)))],
                                    out=str(root / "shards"), workers=1, progress=False))
    return (root / "shards" / "manifest.json").read_text()


@pytest.mark.parametrize("case", ["no_manifest", "dst_is_a_file", "dst_holds_other_files", "dst_is_a_url",
                                  "src_missing", "src_as_a_file_url"])
def test_fetch_bad_arguments_are_one_line_exit_2(case, small_manifest, tmp_path, capsys, monkeypatch):
    from shards_schema.cli import main

    src = tmp_path / "src"
    src.mkdir()
    if case != "no_manifest":
        (src / "manifest.json").write_text(small_manifest)
    dst = tmp_path / "dst"
    if case == "dst_is_a_file":
        dst.write_text("x")
    elif case == "dst_holds_other_files":
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
    elif case == "dst_is_a_url":  # it was copied into the local directory `s3:/data/copy`
        monkeypatch.chdir(tmp_path)
        dst = "s3://data/copy"
    given = {"src_missing": str(tmp_path / "nope"), "src_as_a_file_url": src.as_uri()}.get(case, str(src))
    assert main(["fetch", given, str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert {"no_manifest": "no manifest.json", "dst_is_a_file": "is a file, not a directory",
            "dst_holds_other_files": "is not empty", "src_missing": "nope: no such directory",
            "src_as_a_file_url": f"the source {src.as_uri()!r}: give a local path as itself ({src}), without file://",
            "dst_is_a_url": "s3://data/copy: fetch copies a shard directory to local disk; give a local directory"}[case] in err
    assert not (tmp_path / "s3:").exists()
    if case == "dst_holds_other_files":
        assert (dst / "notes.txt").read_text() == "mine"


def test_fetch_of_a_source_missing_a_listed_shard_is_one_line_exit_1(tmp_path, capsys):
    """A shard the source's manifest lists but the source lacks is a damaged source, as a shard
    that does not match is: exit 1, one line naming it, no manifest written."""
    import shutil

    from shards_schema.cli import main

    src = tmp_path / "src"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", example_rows(4, seed=2)))],
                                    out=str(src), workers=1, rows_per_shard=2, progress=False))
    names = sorted(p.name for p in src.glob("shard-*.arrow"))
    assert len(names) == 2
    (src / names[1]).unlink()
    assert main(["fetch", str(src), str(tmp_path / "dst"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src / names[1]} is missing, and the source's manifest.json lists it" in err, err
    assert not (tmp_path / "dst" / "manifest.json").exists()
    shutil.copy(tmp_path / "src" / names[0], tmp_path / "src" / names[1])  # a wrong file there is still exit 1
    assert main(["fetch", str(src), str(tmp_path / "dst"), "--no-progress"]) == 1
    assert "does not match the manifest" in capsys.readouterr().err


def test_fetch_of_a_source_with_a_fifo_or_without_its_rejects_stops_at_once_in_one_line(tmp_path, capsys):
    """A FIFO where the source's manifest or a shard should be is refused without waiting on it;
    a source without its rejects.jsonl is incomplete: exit 1, no manifest written."""
    import os
    import shutil

    from shards_schema.cli import main

    made = tmp_path / "made"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", example_rows(4, seed=2)))],
                                    out=str(made), workers=1, rows_per_shard=2, progress=False))
    shard = sorted(p.name for p in made.glob("shard-*.arrow"))[1]
    for name, code, said in ((shard, 1, "is a FIFO (named pipe), not a regular file"),
                             ("manifest.json", 2, "is a FIFO (named pipe), not a regular file"),
                             ("rejects.jsonl", 1, "rejects.jsonl is missing, which every shard directory holds")):
        src, dst = tmp_path / f"src-{name}", tmp_path / f"dst-{name}"
        shutil.copytree(made, src)
        (src / name).unlink()
        if name != "rejects.jsonl":
            os.mkfifo(src / name)
        assert main(["fetch", str(src), str(dst), "--no-progress"]) == code, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert not (dst / "manifest.json").exists()


def test_train_on_shards_in_the_store_fetches_a_checked_copy_once_and_trains_as_on_disk(s3, tmp_path):
    """`vlmpack train --data s3://...`: the shards come down into --data-cache with fetch's
    checks, a second run finds them there, and the losses equal a run on the local directory;
    under DP=2 one process per node fetches (into OUT/data_cache) and both train on it."""
    from train.pack_plan import parse_source
    from tests.helpers.shards import preprocess
    from tests.helpers.train import BASE, metrics, ok, run_train

    assert parse_source("s3://data/train-shards:0.5") == ("s3://data/train-shards", 0.5)
    client, _ = s3
    shards = preprocess(tmp_path, "shards")
    _upload_dir(client, shards, "train-shards")
    steps = ["--train-steps", "3"]
    ok(run_train([*BASE, "--data", str(shards), "--out", str(tmp_path / "local"), *steps]))
    want = [m["loss"] for m in metrics(tmp_path / "local")]
    cache = tmp_path / "cache"
    cached = cache / "s3" / "data" / "train-shards"
    damaged = sorted(p.name for p in shards.glob("shard-*.arrow"))[0]
    for run, says in (("first", "fetched"), ("again", "fetched 1 shards (")):
        done = ok(run_train([*BASE, "--data", "s3://data/train-shards", "--data-cache", str(cache),
                             "--out", str(tmp_path / run), *steps]))
        assert f"--data s3://data/train-shards: {says}" in done.stdout, done.stdout
        assert [m["loss"] for m in metrics(tmp_path / run)] == want
        flipped = bytearray((cached / damaged).read_bytes())  # the cache damaged between runs: checked, fetched again
        flipped[len(flipped) // 2] ^= 0xFF
        (cached / damaged).write_bytes(bytes(flipped))
    assert f"{damaged} failed the check and came down again" in done.stdout, done.stdout
    (cached / damaged).write_bytes((shards / damaged).read_bytes())
    assert _outputs(cache / "s3" / "data" / "train-shards") == _outputs(shards)
    ok(run_train([*BASE, "--data", "s3://data/train-shards", "--out", str(tmp_path / "dp2"), *steps], nproc=2))
    np.testing.assert_allclose([m["loss"] for m in metrics(tmp_path / "dp2")], want, rtol=2e-5)
    assert (tmp_path / "dp2" / "data_cache" / "s3" / "data" / "train-shards" / "manifest.json").exists()


@pytest.mark.parametrize("case", ["no_bucket", "damaged_shard", "damaged_shard_dp2"])
def test_train_on_a_store_source_that_cannot_be_fetched_stops_every_rank_with_one_line(case, s3, tmp_path):
    from tests.helpers.shards import preprocess
    from tests.helpers.train import BASE, run_train

    client, _ = s3
    url = "s3://no-such-bucket/shards"
    if case != "no_bucket":
        shards = preprocess(tmp_path, "shards", rows=8)
        prefix = f"bad-{case}"
        _upload_dir(client, shards, prefix)
        name = sorted(p.name for p in shards.glob("shard-*.arrow"))[0]
        bad = bytearray((shards / name).read_bytes())
        bad[len(bad) // 2] ^= 0xFF
        client.put_object(Bucket="data", Key=f"{prefix}/{name}", Body=bytes(bad))
        url = f"s3://data/{prefix}"
    nproc = 2 if case.endswith("dp2") else 1
    done = run_train([*BASE, "--data", url, "--out", str(tmp_path / "run"), "--train-steps", "2"], nproc=nproc,
                     timeout=300)  # a rank left waiting would hang past this
    message = "does not exist" if case == "no_bucket" else "does not match the manifest"
    assert done.returncode == (2 if case == "no_bucket" else 1), done.stderr[-3000:]
    assert message in done.stderr and url in done.stderr, done.stderr[-3000:]
    if nproc == 1:  # the fetch's progress bar, then the one line
        assert done.stderr.strip().splitlines()[-1].startswith("vlmpack train: error: "), done.stderr
        assert done.stderr.count("error") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("port", [40312, 14031, 54030])
def test_an_unreachable_endpoint_whose_port_holds_403_is_not_access_denied(port):
    exc = ConnectionError(f'Could not connect to the endpoint URL: "http://127.0.0.1:{port}/data/rows.jsonl"')
    assert classify(exc, "s3://data/rows.jsonl").kind == "unreachable"
    assert classify(RuntimeError("An error occurred (403) when calling HeadObject: Forbidden"), "s3://data/rows.jsonl").kind == "denied"


def test_missing_credentials_are_named_not_taken_for_the_network():
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    for cause in (NoCredentialsError(), PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY")):
        try:  # s3fs raises its own error from the client's
            try:
                raise cause
            except Exception as inner:
                raise OSError("could not open s3://data/rows.jsonl") from inner
        except OSError as exc:
            error = classify(exc, "s3://data/rows.jsonl")
        assert error.kind == "denied", error
        assert "no credentials" in str(error) and "AWS_ACCESS_KEY_ID" in str(error) and "network" not in str(error)


def test_media_from_a_store_that_never_answers_are_rejected_within_the_timeout(tmp_path):
    """An S3 endpoint that accepts connections and never answers: with --remote-timeout 0.5 and
    --remote-retries 1 the media row is `remote_unreachable` within seconds (botocore's and
    s3fs's own retries would take minutes) and the other rows are written."""
    import threading
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held = []

    def accept_and_wait():
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:  # closed below
                return

    threading.Thread(target=accept_and_wait, daemon=True).start()
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = {**os.environ, **ENV, "FSSPEC_S3_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL": endpoint}
    rows = write_jsonl(tmp_path / "rows.jsonl", _rows_with_urls(["s3://data/img/a.png"]) + example_rows(2, seed=1))
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", str(rows), "--out",
                               str(tmp_path / "o"), "--allow-remote-media", "--remote-timeout", "0.5",
                               "--remote-retries", "1", "--workers", "1", "--no-progress"],
                              capture_output=True, text=True, timeout=120, env=env)
    finally:
        silent.close()
        for conn in held:
            conn.close()
    assert done.returncode == 0, done.stderr
    rejects = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["code"]) for r in rejects] == [(0, "remote_unreachable")], rejects
    assert "tried 2 times" in rejects[0]["reason"]
    assert open_shards(tmp_path / "o").manifest["accounting"]["rows_written"] == 2
    assert time.perf_counter() - started < 60


@pytest.mark.parametrize("out, says", [
    ("s3://no-such-bucket/shards", "--out s3://no-such-bucket/shards: the bucket no-such-bucket does not exist: create "
                                   "it, or give a prefix in a bucket that does"),
    ("s3://", "--out s3:// names no bucket: give s3://BUCKET/PREFIX"),
    ("s3://data/an-object.jsonl", "--out s3://data/an-object.jsonl is an object, not a prefix: give a prefix")])
def test_an_out_prefix_that_cannot_be_written_is_refused_before_the_first_row(out, says, s3, tmp_path, monkeypatch,
                                                                             capsys):
    """The job ran whole in its stage and then failed naming `.../_parts/inputs_seen.json` (a
    missing bucket, `s3://`), or wrote its shards under an object's key."""
    import preprocess.job.local as job
    from shards_schema.cli import main

    client, _ = s3
    client.put_object(Bucket="data", Key="an-object.jsonl", Body=b"{}\n")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    processed = []
    real_process_unit = job.process_unit
    monkeypatch.setattr(job, "process_unit", lambda *a, **k: processed.append(1) or real_process_unit(*a, **k))
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows(2, seed=3, size_range=(32, 64)))
    assert main(["preprocess", str(data), "--out", out, "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vlmpack preprocess: error: {says}"), err
    assert processed == [] and _stages(tmp_path / "tmp") == []
    assert [o["Key"] for o in client.list_objects_v2(Bucket="data", Prefix="an-object.jsonl").get("Contents", [])] == [
        "an-object.jsonl"]
