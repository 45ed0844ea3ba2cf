"""Rows that must be rejected with a named code, never killing or hanging the batch job:
invalid ids, broken Unicode, blank lines, and (in the batch test at the end) every bad kind
of row and media together with good rows."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from preprocess.errors import RejectError
from preprocess.images import load_image_patches
from preprocess.inputs import describe_input, plan_units, read_rows
from preprocess.pipeline import SampleOptions, process_row
from shards_schema import open_shards
from tests.helpers.images import png_header_only  # tiny file, huge header: fails if its pixels are decoded

GOOD_MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def _process(row: dict, profile, **options):
    return process_row(row, sample_uid="in.jsonl:0", source="in.jsonl:0", profile=profile,
                       options=SampleOptions(**options))


@pytest.mark.parametrize(
    "row_id, needle",
    [
        ("\ud800", "lone surrogate U+D800 in `id` at character 0"),
        ("ok\udc80", "lone surrogate U+DC80 in `id` at character 2"),
        ([1, 2], "got list"),
        ({"a": 1}, "got dict"),
        (1.5, "got float"),
        (True, "got bool"),
    ],
)
def test_bad_ids_are_rejected(builtin_profiles, row_id, needle):
    with pytest.raises(RejectError) as err:
        _process({"id": row_id, "messages": GOOD_MESSAGES}, builtin_profiles["qwen3-vl"])
    assert err.value.code == "bad_id"
    assert needle in err.value.message
    err.value.message.encode("utf-8")  # the reason itself is writable


@pytest.mark.parametrize("row_id, uid", [("conv-7", "conv-7"), (7, "7"), ("", "in.jsonl:0"), (None, "in.jsonl:0")])
def test_good_ids_name_the_sample(builtin_profiles, row_id, uid):
    assert _process({"id": row_id, "messages": GOOD_MESSAGES}, builtin_profiles["qwen3-vl"]).sample_uid == uid


def image_row(uri: str, text: str = "What is it?") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": "A picture."},
        ]
    }


@pytest.mark.parametrize("truncate", [False, True])
def test_length_is_checked_from_image_headers_before_decoding(builtin_profiles, truncate):
    """A 13000x13000 image under the pixel limit in a row too long for --max-seq-len is rejected
    as too_long from its header size alone: its pixels (1.1 GB decoded) are never decoded."""
    uri = "data:image/png;base64," + base64.b64encode(png_header_only(13000, 13000)).decode()
    with pytest.raises(RejectError) as err:
        _process(image_row(uri), builtin_profiles["qwen3-vl"], max_seq_len=2000, truncate=truncate)
    assert err.value.code == "too_long", err.value
    # under a sequence length that fits, the same row gets as far as decoding, which fails
    with pytest.raises(RejectError) as err:
        _process(image_row(uri), builtin_profiles["qwen3-vl"], max_seq_len=10**6)
    assert err.value.code == "bad_image" and err.value.message.startswith("image 0: ")


def test_exif_rotated_image_gets_its_decoded_grid(builtin_profiles):
    """The header gives the stored size; EXIF orientation 6 swaps the sides at decode: the token
    count agrees (smart_resize treats both sides alike), the grid and pixels are the decoded ones."""
    profile = builtin_profiles["qwen3-vl"]
    exif = Image.Exif()
    exif[0x0112] = 6
    raw = np.random.default_rng(4).integers(0, 256, (200, 320, 3), dtype=np.uint8)
    data = _encode(Image.fromarray(raw), "JPEG", quality=95, exif=exif.tobytes())
    uri = _data_uri("image/jpeg", data)
    sample = _process(image_row(uri), profile)
    patches, grid = load_image_patches(uri, profile.vision)
    assert grid[1] > grid[2]  # portrait after rotation
    assert sample.image_grid_thw.tolist() == [list(grid)]
    np.testing.assert_array_equal(sample.pixel_patches, patches)


def test_blank_lines_are_not_rows(tmp_path):
    """Whitespace-only JSONL lines are skipped, not `bad_json`; the rows after them keep their
    line numbers, and the accounting counts rows only."""
    path = tmp_path / "in.jsonl"
    good = json.dumps({"messages": GOOD_MESSAGES})
    path.write_text("\n".join([good, "", "   \t", good, "\r", good, "{broken"]) + "\n")
    inp = describe_input(str(path), rows_per_unit=2)
    units = plan_units([inp], 2)
    rows = [(row, item) for unit in units for row, item in read_rows(unit, 2)]
    assert [row for row, _ in rows] == [0, 3, 5, 6]
    assert sum(unit.num_rows for unit in units) == 4 and inp.identity()["blank_lines"] == 3
    assert isinstance(rows[-1][1], RejectError) and rows[-1][1].code == "bad_json"


# ----------------------------------------------------------------------------- the batch job


def _encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_batch_job_over_good_and_bad_rows(tmp_path):
    """One job over good rows mixed with every bad kind: each bad row is rejected with its code
    at its line, each good row is written, rows read = written + rejected, and nothing hangs
    (a FIFO under --media-root is never opened for reading)."""
    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(5)
    photo = Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    png, jpeg = _encode(photo, "PNG"), _encode(photo, "JPEG")
    (media / "photo.png").write_bytes(png)
    os.mkfifo(media / "pipe.jpg")
    (media / "folder.jpg").mkdir()
    with open(media / "huge.jpg", "wb") as fh:  # sparse: 3 GiB of nothing
        fh.truncate(3 * 2**30)
    frames = [Image.new("RGB", (16, 16), colour) for colour in ("red", "blue")]
    animated = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])

    def chat(user_content, answer="A picture.", **extra):
        return json.dumps({**extra, "messages": [{"role": "user", "content": user_content},
                                                 {"role": "assistant", "content": answer}]})

    def image(uri, text="What is it?"):
        return [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]

    # (line, expected reject code or None for a good row)
    lines = [
        (chat("Hi", "Hello.", id="good-text"), None),
        (chat(image(_data_uri("image/png", png)), id="good-png-uri"), None),
        ("", "blank"),
        (chat(image("photo.png"), id="good-png-file"), None),
        (chat(image(_data_uri("image/jpg", jpeg)), id="good-jpg-uri"), None),
        (chat("Hi", id="\ud800"), "bad_id"),
        (chat("Hi", id=[1, 2]), "bad_id"),
        (chat("Hi", id={"k": 1}), "bad_id"),
        ("   \t ", "blank"),
        (chat("broken \udc80 text"), "bad_text"),
        (chat("Hi", "ok<|im_end|><|im_start|>assistant\nmore"), "special_token_in_text"),
        (chat(image("pipe.jpg")), "not_a_regular_file"),
        (chat(image("folder.jpg")), "not_a_regular_file"),
        (chat(image("huge.jpg")), "media_too_large"),
        (chat(image("data:image/png;base64," + "A" * 1_500_000)), "media_too_large"),
        (chat(image(_data_uri("image/png", png_header_only(13000, 13000)))), "too_long"),
        ("", "blank"),
        (chat(image(_data_uri("image/gif", animated))), "animated_image"),
        (chat(image(_data_uri("image/png", jpeg))), "mime_mismatch"),
        ("{not json", "bad_json"),
        (chat("Bye", "Goodbye.", id="good-last"), None),
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(line + "\n" for line, _ in lines), encoding="utf-8")
    out = tmp_path / "shards"
    command = [sys.executable, "-m", "shards_schema.cli", "preprocess", str(data), "--out", str(out),
               "--media-root", str(media), "--max-media-bytes", "1000000", "--max-seq-len", "4096",
               "--workers", "2", "--rows-per-shard", "6", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    acc = manifest["accounting"]
    expected_rejects = {row: code for row, (_, code) in enumerate(lines) if code not in (None, "blank")}
    good_ids = {json.loads(line)["id"] for line, code in lines if code is None}
    assert acc["rows_read"] == len(expected_rejects) + len(good_ids) == acc["rows_written"] + acc["rows_rejected"]
    assert acc["rows_written"] == len(good_ids)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["row"]: r["code"] for r in rejects} == expected_rejects, rejects
    assert all(r["source"] == str(data) and r["reason"] for r in rejects)
    assert {open_shards(out)[i]["sample_uid"] for i in range(acc["rows_written"])} == good_ids
    verify = subprocess.run([sys.executable, "-m", "shards_schema.cli", "verify", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# ------------------------------------------------- numeric extremes in every option of a media part

# Run in a child process whose address space is capped (after its imports) at what it holds plus
# CHILD_HEADROOM: an option that makes the pipeline allocate gigabytes fails there with MemoryError
# (reported as "exception"), not the machine. Each case is timed.
CHILD_HEADROOM = 2 * 2**30
_CHILD = r'''
import json, math, resource, sys, time
from pathlib import Path

from preprocess.errors import RejectError
from preprocess.pipeline import SampleOptions, process_row
from preprocess.profiles import builtin_profile
from preprocess.video import VideoOptions

media, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
profiles = {name: builtin_profile(name) for name in ("qwen3-vl", "qwen2.5-vl")}


def run(case):
    options = SampleOptions(media_root=str(media), max_seq_len=case.get("max_seq_len", 4096),
                            video_fit=case.get("video_fit", False), video=VideoOptions(sampling=case["sampling"]))
    started = time.perf_counter()
    try:
        sample = process_row(case["row"], sample_uid="u", source="s", profile=profiles[case["family"]],
                             options=options)
        outcome = ["ok", f"{sample.num_tokens} tokens"]
    except RejectError as exc:
        outcome = [exc.code, exc.message]
    except Exception as exc:  # a traceback: what the test is there to catch
        outcome = ["exception", f"{type(exc).__name__}: {exc}"[:300]]
    return [*outcome, time.perf_counter() - started]


run(cases[0])  # warm up: torch, PyAV and the tokenizer loaded before the cap
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[3]), vm + int(sys.argv[3])))
print(json.dumps([run(case) for case in cases]))
'''


def run_bounded(cases: list[dict], media, tmp_path, timeout: float = 240) -> list:
    """[code or "ok" or "exception", message, seconds] of each case's `process_row`, in a capped child."""
    case_file = tmp_path / "cases.json"
    case_file.write_text(json.dumps(cases))  # NaN and infinities as Python's json writes (and reads) them
    done = subprocess.run([sys.executable, "-c", _CHILD, str(media), str(case_file), str(CHILD_HEADROOM)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Every kind of extreme a JSON number (or a value in its place) can take.
EXTREMES = [True, "8", -1, 0, 0.5, 1e-300, 3, 2**53, 2**53 + 1, 10**7, 10**9, 1e300, math.inf, -math.inf,
            math.nan]
VIDEO_COUNT_OPTIONS = ("nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")


def valid_video_option(name: str, value) -> bool:
    """The documented valid values of a video part's option (docs/preprocessing.md, Videos)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name in VIDEO_COUNT_OPTIONS:
        return float(value).is_integer() and 1 <= value <= 2**53
    if name == "fps":
        return value >= 0.001
    return value >= 0  # video_start, video_end


def _video_chat(source, **options) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": source, **options},
                                                      {"type": "text", "text": "What happens?"}]},
                         {"role": "assistant", "content": "Colours drift."}]}


def _image_chat(uri, **options) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}, **options},
                                                      {"type": "text", "text": "What is it?"}]},
                         {"role": "assistant", "content": "A picture."}]}


def test_every_media_option_at_every_extreme_is_valid_or_a_named_reject(tmp_path):
    """Fields x values over image and video parts (a video file, a list of frames; both
    families; hf and qwen-vl-utils sampling): each case is written, or rejected with a named
    code (the invalid ones with the option's own code), within seconds and a capped address
    space: no traceback, no hang, no allocation sized by the option (`nframes` 10**9 used to
    allocate 8 GB, 10**7 to run past 90 s)."""
    pytest.importorskip("av", reason="video cases need PyAV")
    pytest.importorskip("torch", reason="video cases need torch")
    from preprocess.examples import synthetic_video_frames, write_video

    media = tmp_path / "media"
    media.mkdir()
    nprng = np.random.default_rng(8)
    write_video(media / "clip.mp4", synthetic_video_frames(nprng, 6, 64, 48), 4.0)
    for k, frame in enumerate(synthetic_video_frames(nprng, 3, 40, 30)):
        Image.fromarray(frame).save(media / f"f{k}.png")
    png = _data_uri("image/png", _encode(Image.fromarray(nprng.integers(0, 256, (30, 40, 3), dtype=np.uint8)), "PNG"))

    cases = [{"row": _video_chat("clip.mp4"), "family": "qwen3-vl", "sampling": "hf"}]  # the warm-up row
    expect = [{"ok"}]
    sized = {"ok", "video_too_long", "video_sampling", "too_long", "bad_video_option"}  # bounds may contradict
    for value in EXTREMES:
        for family, sampling in (("qwen3-vl", "hf"), ("qwen2.5-vl", "hf"), ("qwen3-vl", "qwen-vl-utils")):
            for name in ("fps", *VIDEO_COUNT_OPTIONS, "video_start", "video_end"):
                cases.append({"row": _video_chat("clip.mp4", **{name: value}), "family": family, "sampling": sampling})
                expect.append(sized if valid_video_option(name, value) else {"bad_video_option"})
            for name in ("resized_height", "resized_width"):
                cases.append({"row": _video_chat("clip.mp4", **{name: value}), "family": family, "sampling": sampling})
                expect.append({"unsupported_field"})
        for name in ("fps", "nframes"):  # a list of frames: fps gives its time line
            cases.append({"row": _video_chat([f"f{k}.png" for k in range(3)], **{name: value}), "family": "qwen2.5-vl",
                          "sampling": "hf"})
            expect.append(sized if valid_video_option(name, value) else {"bad_video_option"})
        for name in ("min_pixels", "max_pixels"):
            cases.append({"row": _image_chat(png, **{name: value}), "family": "qwen3-vl", "sampling": "hf"})
            expect.append({"ok", "too_long", "bad_image_option"} if valid_video_option(name, value)
                          else {"bad_image_option"})
        for name in ("resized_height", "resized_width"):
            cases.append({"row": _image_chat(png, **{name: value}), "family": "qwen2.5-vl", "sampling": "hf"})
            expect.append({"unsupported_field"})
    # --video-fit lowers an nframes no sequence could hold until the video alone fits (the row's
    # text may then still overflow it: too_long, as for any video --video-fit sizes to the limit)
    cases.append({"row": _video_chat("clip.mp4", nframes=10**9), "family": "qwen3-vl", "sampling": "hf",
                  "video_fit": True, "max_seq_len": 1024})
    expect.append({"ok", "too_long"})

    results = run_bounded(cases, media, tmp_path)
    failures = [(case["row"]["messages"][0]["content"][0], case["family"], case["sampling"], result)
                for case, want, result in zip(cases, expect, results) if result[0] not in want or result[2] > 5]
    assert not failures, failures[:10]
    assert {result[0] for result in results} >= {"ok", "video_too_long", "bad_video_option", "bad_image_option",
                                                 "unsupported_field", "too_long"}


# ------------------------------------------------------------------ remote media that never comes


@pytest.fixture()
def http_media():
    """Three local endpoints: an HTTP server (200 for /photo.png, 404 otherwise), a socket that
    accepts connections and never answers, and a port nobody listens on."""
    import http.server
    import socket
    import threading

    photo = _encode(Image.fromarray(np.random.default_rng(6).integers(0, 256, (30, 40, 3), dtype=np.uint8)), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = photo if self.path == "/photo.png" else None
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            if body and self.command == "GET":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held = []

    def accept_and_wait():
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:  # closed at teardown
                return

    threading.Thread(target=accept_and_wait, daemon=True).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    yield {"ok": f"http://127.0.0.1:{server.server_address[1]}/photo.png",
           "missing": f"http://127.0.0.1:{server.server_address[1]}/gone.png",
           "silent": f"http://127.0.0.1:{silent.getsockname()[1]}/photo.png",
           "refused": f"http://127.0.0.1:{closed_port}/photo.png"}
    server.shutdown()
    silent.close()
    for conn in held:
        conn.close()


def test_a_fetch_is_bounded_by_its_timeout_and_retries(http_media):
    """A server that never answers times out (each attempt, then each retry); a refused
    connection is unreachable, not missing; a 404 is missing at once, without retries."""
    import time

    from shards_schema.storage import FetchPolicy, StorageError, read_bytes

    policy = FetchPolicy(timeout=0.3, retries=2, backoff=0.1)
    assert read_bytes(http_media["ok"], 10**6, policy).startswith(b"\x89PNG")
    for name, kind, most in (("silent", "unreachable", 3 * (2 * 0.3) + 0.3 + 2), ("refused", "unreachable", 2),
                             ("missing", "not_found", 1)):
        started = time.perf_counter()
        with pytest.raises(StorageError) as err:
            read_bytes(http_media[name], 10**6, policy)
        assert err.value.kind == kind, (name, err.value)
        assert ("tried 3 times" in str(err.value)) == (kind == "unreachable"), err.value
        assert time.perf_counter() - started < most, name


def test_remote_media_that_never_comes_is_rejected_and_the_job_goes_on(http_media, tmp_path):
    """With --allow-remote-media and a small --remote-timeout, a job over rows whose images sit
    on a server that never answers, on a closed port and behind a 404 finishes: those rows are
    `remote_unreachable`, `remote_unreachable` and `remote_not_found`, every other row (one
    fetched over HTTP) is written."""
    import time

    lines = [(image_row(http_media["ok"]), None), (image_row(http_media["silent"]), "remote_unreachable"),
             ({"messages": GOOD_MESSAGES}, None), (image_row(http_media["refused"]), "remote_unreachable"),
             (image_row(http_media["missing"]), "remote_not_found"), ({"messages": GOOD_MESSAGES}, None)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row, _ in lines))
    out = tmp_path / "shards"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shards_schema.cli", "preprocess", str(data), "--out", str(out),
                           "--allow-remote-media", "--remote-timeout", "0.5", "--remote-retries", "1", "--workers",
                           "1", "--no-progress"], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    rejects = {r["row"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    assert {row: r["code"] for row, r in rejects.items()} == {k: code for k, (_, code) in enumerate(lines) if code}
    assert "tried 2 times" in rejects[1]["reason"] and "tried 2 times" in rejects[3]["reason"]
    assert open_shards(out).manifest["accounting"]["rows_written"] == 3
    # the silent server costs 2 attempts x (HEAD + GET) x 0.5 s + a 1 s pause; the rest is start-up
    assert elapsed < 60, elapsed
# ----------------------------------------------------------------------------- bounded rows

_LIMITED_JOB = r"""
import json, resource, sys
from shards_schema.cli import main
warm_up, argv, budget = json.loads(sys.argv[1])
if main(warm_up) != 0:
    sys.exit("the warm-up job failed")
peak = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmPeak:"))
resource.setrlimit(resource.RLIMIT_AS, (peak + budget, peak + budget))
sys.exit(main(argv))
"""


def _row_of_text(text_bytes: int) -> bytes:
    """A JSONL row whose assistant answer is ASCII words of `text_bytes` bytes in all."""
    head, tail = json.dumps({"messages": [{"role": "user", "content": "Tell a long story."},
                                          {"role": "assistant", "content": "@"}]}).split("@")
    words = b"once upon a time " * (text_bytes // 17 + 1)
    return head.encode() + words[: text_bytes - len(head) - len(tail)] + tail.encode()


@pytest.mark.parametrize("truncate", [False, True])
def test_rows_over_the_byte_limit_and_texts_too_long_to_fit_keep_memory_bounded(tmp_path, truncate):
    """A JSONL and a JSON input each hold good rows, a row of text just under --max-row-bytes
    (4 MiB) and one far over it (64 MiB). The job runs in a process whose address space may grow
    by 4x the row limit plus 256 MiB past what a small job reached (RLIMIT_AS): the long row is
    rejected as row_too_large without being held; the text just under the limit, which
    --max-seq-len 1024 could never hold, is rejected as too_long before it is tokenized
    (tokenizing it would take about 600 MB), or with --truncate only its head is tokenized and
    the row written. The rows after them are written."""
    limit = 4 << 20
    good = json.dumps({"messages": GOOD_MESSAGES}).encode()
    rows = [good, _row_of_text(limit - 100), _row_of_text(64 << 20), good]
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    (tmp_path / "rows.json").write_bytes(b"[" + b",\n".join(rows) + b"]")
    (tmp_path / "small.jsonl").write_bytes(good + b"\n")
    common = ["--workers", "1", "--no-progress", "--max-seq-len", "1024", "--max-row-bytes", str(limit)]
    warm_up = ["preprocess", str(tmp_path / "small.jsonl"), "--out", str(tmp_path / "warm"), *common]
    out = tmp_path / "out"
    argv = ["preprocess", str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.json"), "--out", str(out), *common,
            *(["--truncate"] if truncate else [])]
    result = subprocess.run([sys.executable, "-c", _LIMITED_JOB, json.dumps([warm_up, argv, 4 * limit + (256 << 20)])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    expected = {1: "too_long", 2: "row_too_large"} if not truncate else {2: "row_too_large"}
    for name in ("rows.jsonl", "rows.json"):
        assert {r["row"]: r["code"] for r in rejects if r["source"].endswith(name)} == expected
    assert any("more than --max-row-bytes 4,194,304" in r["reason"] for r in rejects)
    acc = json.loads((out / "manifest.json").read_text())["accounting"]
    assert acc["rows_written"] == 2 * (4 - len(expected))
    if truncate:
        shards = open_shards(out)
        assert sorted(len(shards[i]["input_ids"]) for i in range(len(shards)))[-2:] == [1024, 1024]


HEAD_PIECES = ["the", "cat", "Hello", "it's", "we'll", "I'M", " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", ",", ".", "!",
               "?", "'", '"', "(", ")", "[", "]", "{", "}", ";", ":", "123", "4", "_", "-", "—", "$", "#", "ü", "é",
               "e\u0301", "A\u030a", "\u212b", "\u0958", "क", "\u093c", "我爱你", "，", "。", "、", "！", "한국어",
               "\u1100\u1161\u11a8", "\u1100", "\u1161", "ｶﾞ", "😀", "👍🏽", "ǅ", "ﬁ", "ß", "Σ", "ς", "عربي", "\u200d",
               "\u0301", "\u0338", ">", "<", "=", "١٢", "①", "½", "<|im_end|>", "<|vision_start|>", "<think>",
               "</think>", "<tool_call>"]


def test_a_head_cut_where_the_tokenizer_splits_gives_the_whole_texts_first_tokens(builtin_profiles):
    """`TextBudget.head_end` cuts a text just after a letter that whitespace or punctuation
    follows, outside any added token: the head's token ids are the whole text's first ids. The
    tokenizer itself is the oracle, on random texts of ASCII words, contractions, punctuation,
    digits, CJK, Hangul syllables and conjoining jamo, accents precomposed and combining (ones
    NFC composes, reorders or splits), emoji, Arabic and special tokens. A cut inside a word
    (the control) does change the first tokens."""
    profile = builtin_profiles["qwen3-vl"]
    tokenizer = profile.tokenizer
    budget = dataclasses.replace(profile.text_budget, longest_token_bytes=1)  # small heads: cuts everywhere

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    rng = random.Random(11)
    cuts = 0
    for _ in range(300):
        text = "".join(rng.choice(HEAD_PIECES) for _ in range(rng.randint(20, 200)))
        whole = ids(text)
        for _ in range(3):
            end = budget.head_end(text, rng.randint(1, len(text)), tokenizer)
            if end is not None:
                head = ids(text[:end])
                assert whole[: len(head)] == head, (text[:end], text[end:])
                cuts += 1
    assert cuts > 500
    assert ids("unbelievably")[:1] != ids("unbeliev")[:1] or ids("unbelievably")[:2] != ids("unbeliev")


def test_truncate_tokenizes_only_a_head_and_gives_what_cutting_the_whole_texts_ids_gives(builtin_profiles, monkeypatch):
    """A text too long for --max-seq-len by its length alone (more bytes than --max-seq-len times
    the longest token) is rejected as too_long before it is tokenized; under --truncate only a
    head of it is tokenized, and the sample equals tokenizing the whole rendered text and cutting
    its ids and loss mask (what --truncate always did), with an image before the text too. An
    image after the cut is too_long, as the cut would fall before it."""
    import preprocess.pipeline as pipeline
    from preprocess.families import family_named
    from preprocess.render import render_conversation, tokenize_rendered
    from preprocess.text_budget import HEAD_CUT_WINDOW

    profile = builtin_profiles["qwen3-vl"]
    rng = random.Random(5)
    story = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "é", "我爱你，", "don't", "1984"])
                     for _ in range(40_000))
    image = _data_uri("image/png", _encode(Image.new("RGB", (28, 28), "red"), "PNG"))
    tokenized = []
    monkeypatch.setattr(pipeline, "tokenize_rendered",
                        lambda rendered, tok: tokenized.append(len(rendered.text)) or tokenize_rendered(rendered, tok))
    for content in ("Tell a story.", [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "And?"}]):
        row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": story}]}
        tokenized.clear()
        with pytest.raises(RejectError) as err:
            _process(row, profile, max_seq_len=256)
        assert err.value.code == "too_long" and "make at least" in err.value.message and not tokenized
        sample = _process(row, profile, max_seq_len=256, truncate=True)
        rendered = render_conversation(row["messages"], family=family_named("qwen3-vl"), special_tokens=profile.text_special_tokens)
        ids, mask = tokenize_rendered(rendered, profile.tokenizer)
        if isinstance(content, list):
            pad = profile.special.image_pad
            grid = sample.image_grid_thw[0]
            ids, mask = pipeline.expand_image_pads(ids, mask, np.asarray([grid.prod() // 4]), pad)
        assert sample.input_ids.tolist() == ids[:256].tolist()
        assert sample.loss_mask.tolist() == mask[:256].tolist()
        assert tokenized[-1] <= 256 * profile.text_budget.longest_token_bytes + HEAD_CUT_WINDOW < len(rendered.text)
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": story},
                                                    {"type": "image_url", "image_url": {"url": image}}]},
                        {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(RejectError) as err:
        _process(row, profile, max_seq_len=256, truncate=True)
    assert err.value.code == "too_long" and "before an image or a video" in err.value.message


def _through_json(row: dict) -> dict:
    """`row` as the reader gives it from its JSON text (NaN and Infinity literals included)."""
    return json.loads(json.dumps(row))


def _with(**assistant) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", **assistant},
                         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]}


def _tool_row(arguments, tool_default=0) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": tool_default}}}],
            "messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": arguments}}]},
                         {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}


def _sharegpt(call: str = '{"name": "f", "arguments": {}}', **extra) -> dict:
    return {**extra, "conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": call},
                                       {"from": "observation", "value": "r"}, {"from": "gpt", "value": "done"}]}


def _swift(loss, role: str = "assistant") -> dict:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    messages[1 if role == "assistant" else 0]["loss"] = loss
    return {"messages": messages, "images": []}


NAN, INF = float("nan"), float("inf")
NUMERIC_FIELDS = [  # (layout, row, None: written, or the reject code)
    *[("openai", {**_with(), "id": value}, None) for value in (10**4000, -5, 0, "5", "-1e309")],
    *[("openai", {**_with(), "id": value}, "bad_id") for value in (NAN, INF, -INF, 1e308, 1.0, -0.0, True, False)],
    *[("openai", _with(weight=value), None) for value in (0, 1, 0.0, 1.0, None)],
    *[("openai", _with(weight=value), "bad_message")
      for value in (2, -1, 0.5, 1e-300, NAN, INF, -INF, True, False, "1", "0", 10**100, [1], {"w": 1})],
    ("openai", {"messages": [{"role": "user", "content": "Hi", "weight": 1}, *_with()["messages"][1:]]}, "bad_message"),
    ("openai", _with(weight=0, train=True), "bad_message"),
    *[("openai", _with(train=value), "bad_message") for value in (1, 0, "true", NAN)],
    *[("openai", _tool_row({"x": value}), None) for value in (1e308, 5e-324, 10**100, -0.0, 0, -1, True, "NaN")],
    *[("openai", _tool_row({"x": value}), "bad_tool_call") for value in (NAN, INF, -INF)],
    ("openai", _tool_row({"x": {"y": [1, NAN]}}), "bad_tool_call"),
    *[("openai", _tool_row({}, tool_default=value), "bad_tools") for value in (NAN, INF, -INF)],
    ("sharegpt", _sharegpt(), None),
    ("sharegpt", _sharegpt('{"name": "f", "arguments": {"x": 1e999}}'), "bad_tool_call"),
    ("sharegpt", _sharegpt('{"name": "f", "arguments": {"x": NaN}}'), "bad_tool_call"),
    ("sharegpt", _sharegpt('{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}"), "bad_tool_call"),
    ("sharegpt", _sharegpt("[" * 100_000 + "]" * 100_000), "bad_tool_call"),
    ("sharegpt", _sharegpt('{"name": 5, "arguments": {}}'), "bad_tool_call"),
    ("sharegpt", _sharegpt(tools='[{"name": "f", "parameters": {"default": NaN}}]'), "bad_tools"),
    ("sharegpt", _sharegpt(tools="[" * 100_000 + "]" * 100_000), "bad_tools"),
    *[("sharegpt", _sharegpt(system=value), "bad_content") for value in (5, NAN, 0, True)],
    ("sharegpt", _sharegpt(system=""), None),
    *[("swift", _swift(value), None) for value in (True, False, None)],
    *[("swift", _swift(value), "bad_message") for value in (1, 0, 1.0, "true", NAN, INF)],
    ("swift", _swift(True, role="user"), "bad_message"),
    ("swift", _swift(False, role="user"), None),
]


@pytest.mark.parametrize("layout, row, code", NUMERIC_FIELDS, ids=[f"{k}-{c[0]}-{c[2]}" for k, c in enumerate(NUMERIC_FIELDS)])
def test_numbers_in_every_row_field_are_valid_or_rejected_with_a_code(builtin_profiles, layout, row, code):
    """Huge, tiny, infinite and NaN numbers (JSON's NaN / Infinity literals, as Python's json
    reads them), negative numbers, zero, booleans and numbers written as strings, in every field
    of a row the layouts read that is not a media part's: ids, OpenAI's `weight`, `train`,
    tool-call arguments, tool schemas, ShareGPT's function calls, tools and system, ms-swift's
    `loss`. Each is a documented value (the row is written) or the row is rejected with a code;
    a target never holds NaN or Infinity, which are not JSON."""
    from preprocess.formats import to_openai_row

    if code is None:
        sample = _process(to_openai_row(_through_json(row), layout), builtin_profiles["qwen3-vl"])
        if "id" in row:
            assert sample.sample_uid == str(row["id"])
    else:
        with pytest.raises(RejectError) as err:
            _process(to_openai_row(_through_json(row), layout), builtin_profiles["qwen3-vl"])
        assert err.value.code == code, err.value


def test_weight_and_loss_decide_a_turns_loss_as_train_does(builtin_profiles):
    """OpenAI's `weight: 0` and ms-swift's `loss: false` leave an assistant turn out of the loss
    as `train: false` does (here against the all_assistant policy, which would train it);
    `weight: 1` and `loss: true` train it as `train: true` does (against last_assistant, which
    would not)."""
    from preprocess.formats import to_openai_row

    profile = builtin_profiles["qwen3-vl"]
    for flag, weight, loss, policy in ((False, 0, False, "all_assistant"), (True, 1, True, "last_assistant")):
        want = _process(_with(train=flag), profile, loss_policy=policy).loss_mask.tolist()
        assert want != _process(_with(), profile, loss_policy=policy).loss_mask.tolist()
        for row in (_with(weight=weight), to_openai_row(_swift(loss), "swift")):
            assert _process(row, profile, loss_policy=policy).loss_mask.tolist() == want


def test_max_row_bytes_must_be_positive(tmp_path, capsys):
    from preprocess.errors import ConfigError
    from preprocess.job import PreprocessConfig, run_preprocess
    from tests.helpers.cli import vlmpack_exit_code

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": GOOD_MESSAGES}) + "\n")
    for value in ("0", "-1"):
        code = vlmpack_exit_code(["preprocess", str(data), "--out", str(tmp_path / "out"), "--max-row-bytes", value])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"--max-row-bytes: must be a positive number of bytes, got {value}" in err
    with pytest.raises(ConfigError, match="--max-row-bytes must be an integer >= 1, got 0"):
        run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "out"), progress=False,
                                        sample=SampleOptions(max_row_bytes=0)))
    assert not (tmp_path / "out").exists()
