"""`vlmpack inspect` and `vlmpack show` on one small real shard directory.

Numbers are checked against values computed independently from `open_shards` (full rows,
not the offsets-only path inspect uses); `patches_to_image` is checked to be the exact
inverse of `preprocess.images.image_to_patches`; the HTML report is opened in headless
Chromium when /usr/bin/chromium exists.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preprocess.examples import example_rows, write_jsonl
from preprocess.images import image_to_patches, smart_resize
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema.builtin import BUILTIN_VISION, bundled_tokenizer_dir
from preprocess.show import TARGET_CLOSE, TARGET_OPEN
from shards_schema import open_shards
from shards_schema.cli import main as vlmpack
from shards_schema.inspect import distribution, inspect_shards, patches_to_image

ROWS = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(shard dir, input rows by id): 12 example chats + 2 broken rows, 2 shards."""
    rows = example_rows(ROWS, seed=5, size_range=(32, 160), include_bad_rows=True)
    root = tmp_path_factory.mktemp("inspect")
    jsonl = write_jsonl(root / "chats.jsonl", rows)
    out = root / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(jsonl)], out=str(out), workers=1, rows_per_shard=8, progress=False))
    return out, {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def independent(data):
    """Per-sample numbers from full rows (input_ids, loss_mask, image_grid_thw values)."""
    shards = open_shards(data[0])
    merge = shards.manifest["profile"]["vision"]["merge_size"]
    rows = [shards[i] for i in range(len(shards))]
    lengths = np.array([len(r["input_ids"]) for r in rows])
    targets = np.array([int(r["loss_mask"].sum()) for r in rows])
    images = np.array([len(r["image_grid_thw"]) for r in rows])
    visual = np.array([int(r["image_grid_thw"].prod(axis=1).sum()) // merge**2 for r in rows])
    patches = np.array([len(r["pixel_patches"]) for r in rows])
    return dict(lengths=lengths, targets=targets, images=images, visual=visual, patches=patches)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = vlmpack(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _pick_sample(data, min_images=1) -> tuple[int, dict, dict]:
    """(index, stored sample, input row): a sample with images and no tool calls."""
    out, rows = data
    shards = open_shards(out)
    for i in range(len(shards)):
        sample = shards[i]
        row = rows[sample["sample_uid"]]
        if len(sample["image_grid_thw"]) >= min_images and not any("tool_calls" in m for m in row["messages"]):
            return i, sample, row
    raise AssertionError("no suitable sample in the fixture data")


# ------------------------------------------------------------------------ inspect


def test_inspect_text_totals_rejects_and_histograms(data, capsys):
    out, _ = data
    manifest = json.loads((out / "manifest.json").read_text())
    t, acc = manifest["totals"], manifest["accounting"]
    code, text, _ = _cli(capsys, "inspect", str(out))
    assert code == 0
    assert f"fingerprint {manifest['profile']['id']}" in text and manifest["profile"]["family"] in text
    assert re.search(rf"^rows\s+{t['rows']:,}$", text, re.M)
    assert re.search(rf"^tokens\s+{t['tokens']:,}\s+targets {t['target_tokens']:,} ", text, re.M)
    visual = t["patches"] // manifest["profile"]["vision"]["merge_size"] ** 2
    assert re.search(rf"^images\s+{t['images']:,}\s+visual tokens {visual:,} ", text, re.M)
    assert f"{t['shards']} files" in text and f"{t['bytes']:,} bytes" in text
    assert f"{acc['rows_read']:,} rows read = {acc['rows_written']:,} written + {acc['rows_rejected']:,} rejected" in text
    assert "HF float32 pixel_values 24,576" in text  # 4 * (3*2*16*16) * 2^2 for qwen3-vl
    assert re.search(r"^sample uids\s+all unique$", text, re.M)
    # rejects by reason, with the first example's reason from rejects.jsonl
    first = {}
    for line in (out / "rejects.jsonl").read_text().splitlines():
        rec = json.loads(line)
        first.setdefault(rec["code"], rec)
    for code_, count in acc["rejects_by_reason"].items():
        assert re.search(rf"^  {code_}\s+{count} .*{re.escape(first[code_]['reason'])}", text, re.M)
    # one histogram per distribution; its bars add up to the row count
    for label in ("sequence length", "images per sample", "visual tokens per sample", "target fraction"):
        block = text.split(f"\n{label}")[1].split("\n\n")[0]
        assert f"count {t['rows']:,}" in block.splitlines()[0]
        bars = [line for line in block.splitlines() if "│" in line]
        assert 1 <= len(bars) <= 12
        assert sum(int(re.search(r"\s([\d,]+)\s+[\d.]+%$", b).group(1).replace(",", "")) for b in bars) == t["rows"]


def test_inspect_json_matches_independent_counts(data, independent, capsys):
    out, _ = data
    code, text, _ = _cli(capsys, "inspect", str(out), "--json")
    assert code == 0
    report = json.loads(text)
    assert report == json.loads(json.dumps(inspect_shards(out)))
    t, ind = report["totals"], independent
    assert t["rows"] == len(ind["lengths"])
    assert t["tokens"] == ind["lengths"].sum()
    assert t["target_tokens"] == ind["targets"].sum()
    assert t["images"] == ind["images"].sum()
    assert t["patches"] == ind["patches"].sum()
    assert t["visual_tokens"] == ind["visual"].sum()
    assert t["target_fraction"] == pytest.approx(ind["targets"].sum() / ind["lengths"].sum())
    assert t["bytes"] == sum(p.stat().st_size for p in out.glob("*.arrow"))
    assert t["bytes_per_visual_token"] == pytest.approx(t["bytes"] / t["visual_tokens"])
    assert t["hf_pixel_values_bytes_per_visual_token"] == 4 * 3 * 2 * 16 * 16 * 4
    assert report["consistency"] == []
    assert (t["repeated_sample_uids"], t["rows_with_repeated_uid"]) == (0, 0)
    assert {r["code"]: r["count"] for r in report["rejects"]} == {"bad_base64": 1, "unknown_role": 1}
    assert report["accounting"]["rows_read"] == ROWS + 2

    for name, values in [("seq_len", ind["lengths"]), ("images_per_sample", ind["images"]),
                         ("visual_tokens_per_sample", ind["visual"]),
                         ("target_fraction", ind["targets"] / ind["lengths"])]:
        dist = report["distributions"][name]
        assert dist["count"] == len(values)
        assert dist["min"] == pytest.approx(values.min()) and dist["max"] == pytest.approx(values.max())
        assert dist["mean"] == pytest.approx(values.mean())
        for q in (50, 90, 99):
            assert dist[f"p{q}"] == pytest.approx(np.percentile(values, q, method="inverted_cdf"))
        for b in dist["bins"]:  # every bin count recomputed from the independent values
            if dist["integer"]:
                expected = np.count_nonzero((values >= b["lo"]) & (values <= b["hi"]))
            else:
                last = b is dist["bins"][-1]
                expected = np.count_nonzero((values >= b["lo"]) & ((values <= b["hi"]) if last else (values < b["hi"])))
            assert b["count"] == expected, (name, b)
        assert sum(b["count"] for b in dist["bins"]) == len(values)


def test_distribution_bins_and_percentiles():
    d = distribution(np.arange(100), integer=True)
    assert [(b["lo"], b["hi"], b["count"]) for b in d["bins"]] == [(10 * i, 10 * i + 9, 10) for i in range(10)]
    assert (d["min"], d["p50"], d["p90"], d["p99"], d["max"]) == (0, 49, 89, 98, 99)
    d = distribution(np.array([0, 1, 1, 3]), integer=True)  # small ranges: one bin per value
    assert [(b["lo"], b["hi"], b["count"]) for b in d["bins"]] == [(0, 0, 1), (1, 1, 2), (2, 2, 0), (3, 3, 1)]
    d = distribution(np.array([0.0, 0.05, 0.5, 1.0]), integer=False, value_range=(0.0, 1.0))
    assert len(d["bins"]) == 10 and d["bins"][0]["count"] == 2 and d["bins"][-1]["count"] == 1
    assert distribution(np.zeros(0, np.int64), integer=True)["bins"] == []


def test_inspect_plots_and_html_report(data, tmp_path, capsys):
    out, _ = data
    plots = tmp_path / "plots"
    code, text, _ = _cli(capsys, "inspect", str(out), "--plots", str(plots))
    assert code == 0 and str(plots / "report.html") in text
    pngs = sorted(plots.glob("*.png"))
    assert {p.stem for p in pngs} == {"seq_len", "images_per_sample", "visual_tokens_per_sample", "target_fraction"}
    report_html = (plots / "report.html").read_text(encoding="utf-8")
    for png in pngs:
        raw = png.read_bytes()
        assert raw.startswith(PNG_MAGIC) and len(raw) > 5000
        assert base64.b64encode(raw).decode() in report_html  # embedded, not linked
    links = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", report_html)
    assert len(links) == len(pngs) and all(link.startswith("data:image/png;base64,") for link in links)  # self-contained
    assert "http://" not in report_html and "https://" not in report_html
    t = json.loads((out / "manifest.json").read_text())["totals"]
    for number in (t["rows"], t["tokens"], t["target_tokens"], t["images"]):
        assert f">{number:,}" in report_html
    assert "bad_base64" in report_html and "unknown_role" in report_html


def test_inspect_errors_exit_2(tmp_path, capsys):
    code, out, err = _cli(capsys, "inspect", str(tmp_path))
    assert code == 2 and "no manifest.json" in err and out == ""
    code, _, err = _cli(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and "no such directory" in err
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    code, _, err = _cli(capsys, "inspect", str(tmp_path))
    assert code == 2 and "not a vlmpack manifest" in err


def test_inspect_plots_are_refused_into_the_shard_directory(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    for plots in (f"{shards}/.", f"{shards}/charts"):
        code, out, err = _cli(capsys, "inspect", str(shards), "--plots", plots)
        assert code == 2 and err.count("\n") == 1 and "input directory" in err, err
    assert sorted(p.name for p in shards.iterdir()) == ["manifest.json"]


def test_plots_and_saved_images_never_write_over_or_through_a_users_file(data, tmp_path, capsys):
    """`inspect --plots` and `show --save-images` write into an empty directory or one holding
    only their own earlier output; a user's file of one of their names, a link of one, another
    command's output or any other file is refused in one line and left as it was."""
    index, sample, _ = _pick_sample(data)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    image = f"sample-{index:06d}-image-0.png"
    for argv, name in ((["show", str(data[0]), "--index", str(index), "--save-images"], image),
                       (["inspect", str(data[0]), "--plots"], "report.html")):
        for kind in ("file", "link", "other"):
            out = tmp_path / f"{argv[0]}-{kind}"
            out.mkdir()
            if kind == "file":
                (out / name).write_text("mine")
            elif kind == "link":
                (out / name).symlink_to(victim)
            else:
                (out / "notes.txt").write_text("mine")
            before = {p.name: p.read_bytes() for p in out.iterdir()}
            code, _, err = _cli(capsys, *argv, str(out))
            assert code == 2 and err.count("\n") == 1 and "did not write" in err, (kind, err)
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before and victim.read_text() == "mine"
        out = tmp_path / f"{argv[0]}-again"
        for _ in range(2):  # its own output it replaces
            code, _, err = _cli(capsys, *argv, str(out))
            assert code == 0 and (out / name).stat().st_size > 0, err
    # one command's output is another's foreign files
    code, _, err = _cli(capsys, "show", str(data[0]), "--index", str(index), "--save-images", str(tmp_path / "inspect-again"))
    assert code == 2 and "did not write" in err
    # show adds another sample's images beside the first's
    other = next(i for i in range(len(open_shards(data[0]))) if i != index and len(open_shards(data[0])[i]["image_grid_thw"]))
    code, _, _ = _cli(capsys, "show", str(data[0]), "--index", str(other), "--save-images", str(tmp_path / "show-again"))
    assert code == 0 and (tmp_path / "show-again" / f"sample-{other:06d}-image-0.png").is_file()
    assert (tmp_path / "show-again" / image).is_file()


@pytest.mark.parametrize("error, says, exit_code", [
    (PermissionError(13, "Permission denied", "/data/shards/manifest.json"),
     "permission denied: /data/shards/manifest.json: this user may not open it; fix its permissions", 2),
    (OSError(5, "Input/output error", "/data/shards/shard-000000.arrow"),
     "input/output error at /data/shards/shard-000000.arrow: the storage failed", 1),
])
def test_inspect_names_a_file_the_system_would_not_read(tmp_path, capsys, monkeypatch, error, says, exit_code):
    """A read the operating system refuses (tests run as root, whom permissions do not stop, so
    the refusal is raised where inspect reads): one line naming the file, as every command
    words it, not Python's `[Errno 13]`; the storage failing (EIO) is a fault, exit 1."""
    import shards_schema.inspect as inspect_module

    def refuse(directory):
        raise error

    monkeypatch.setattr(inspect_module, "_collect", refuse)
    code, out, err = _cli(capsys, "inspect", str(tmp_path))
    assert code == exit_code and out == "" and err.count("\n") == 1 and err.startswith("vlmpack inspect: error: "), err
    assert says in err and "Errno" not in err, err


def test_inspect_and_show_with_repeated_input_ids(tmp_path, capsys):
    rows = example_rows(6, seed=2, size_range=(32, 64))
    for row, uid in zip(rows, ["a", "b", "a", "c", "a", "b"]):
        row["id"] = uid
    out = tmp_path / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "chats.jsonl", rows))], out=str(out), workers=1,
                                    rows_per_shard=4, progress=False))
    totals = inspect_shards(out)["totals"]
    assert (totals["repeated_sample_uids"], totals["rows_with_repeated_uid"]) == (2, 5)
    code, text, _ = _cli(capsys, "inspect", str(out))
    assert code == 0 and re.search(r"^sample uids\s+2 repeated, in 5 rows ", text, re.M)
    code, text, err = _cli(capsys, "show", str(out), "--uid", "a")
    assert code == 0 and "note: sample_uid 'a' occurs 3 times (indices [0, 2, 4]); showing index 0" in err
    assert _cli(capsys, "show", str(out), "--index", "0")[1] == text


def test_inspect_and_show_uid_never_import_pandas(data):
    """pyarrow imports pandas (a quarter second) for scalars made from Python objects and `to_numpy`."""
    code = ("import sys; from shards_schema import open_shards; from shards_schema.inspect import inspect_shards; "
            "from preprocess.show import find_uid; inspect_shards(sys.argv[1]); find_uid(open_shards(sys.argv[1]), 'x'); "
            "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(data[0])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_inspect_subprocess_exit_code(data, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "shards_schema.cli", "inspect", str(data[0]), "--json"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["totals"]["rows"] == ROWS
    bad = subprocess.run([sys.executable, "-m", "shards_schema.cli", "inspect", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr


def test_inspect_and_show_of_a_directory_with_no_samples(tmp_path, capsys):
    rows = example_rows(0, seed=1, include_bad_rows=True)  # only the two broken rows
    out = tmp_path / "empty"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "bad.jsonl", rows))], out=str(out), workers=1, progress=False))
    code, text, _ = _cli(capsys, "inspect", str(out))
    assert code == 0 and "no samples" in text and "bad_base64" in text
    code, _, _ = _cli(capsys, "inspect", str(out), "--plots", str(tmp_path / "plots"))
    assert code == 0 and (tmp_path / "plots" / "report.html").is_file()
    code, _, err = _cli(capsys, "show", str(out))
    assert code == 2 and "holds no samples" in err


# ------------------------------------------------------------------------ patches_to_image


@pytest.mark.parametrize("family", sorted(BUILTIN_VISION))
def test_patches_to_image_inverts_image_to_patches(family):
    vision = BUILTIN_VISION[family]
    factor = vision.resize_factor
    height, width = 8 * factor, 10 * factor  # already multiples of P*m, area within the bounds
    assert smart_resize(height, width, factor, vision.min_pixels, vision.max_pixels) == (height, width)
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    patches, grid = image_to_patches(Image.fromarray(pixels, "RGB"), vision)
    assert grid == (1, height // vision.patch_size, width // vision.patch_size)
    rebuilt = patches_to_image(patches, grid, vision.patch_size, vision.merge_size)
    assert rebuilt.dtype == np.uint8 and rebuilt.shape == pixels.shape
    np.testing.assert_array_equal(rebuilt, pixels)
    with pytest.raises(ValueError, match="does not match grid"):
        patches_to_image(patches[:-1], grid, vision.patch_size, vision.merge_size)


# ------------------------------------------------------------------------ show


def test_show_piped_text_targets_and_images(data, capsys):
    index, sample, row = _pick_sample(data)
    code, text, _ = _cli(capsys, "show", str(data[0]), "--index", str(index))
    assert code == 0 and "\x1b[" not in text
    assert f"sample_uid  {sample['sample_uid']}" in text and f"source      {sample['source']}" in text
    assert f"length      {len(sample['input_ids'])} tokens" in text
    assert f"targets     {int(sample['loss_mask'].sum())} tokens" in text
    assert f"images      {len(sample['image_grid_thw'])}" in text
    body = text.split("\n\n", 1)[1]
    user_texts = [m["content"] if isinstance(m["content"], str) else p["text"]
                  for m in row["messages"] if m["role"] == "user"
                  for p in ([None] if isinstance(m["content"], str) else [q for q in m["content"] if q["type"] == "text"])]
    assert user_texts and all(u in body for u in user_texts)
    assert "<|im_start|>assistant" in body
    replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    # targets are exactly the assistant content + <|im_end|>, the header stays outside
    assert re.findall(re.escape(TARGET_OPEN) + r"(.*?)" + re.escape(TARGET_CLOSE), body, re.S) == [r + "<|im_end|>" for r in replies]
    for reply in replies:
        assert f"<|im_start|>assistant\n{TARGET_OPEN}{reply}<|im_end|>{TARGET_CLOSE}" in body
    merge = 2
    for k, (t, h, w) in enumerate(sample["image_grid_thw"].tolist()):
        assert f"<|vision_start|><image {k}: {t} x {h} x {w}, {t * h * w // merge**2} tokens><|vision_end|>" in body
    assert "<|image_pad|>" not in body


def test_show_color_only_when_forced(data):
    index, _, _ = _pick_sample(data)
    from preprocess.show import Show

    def run(*flags):
        import argparse

        parser = argparse.ArgumentParser()
        Show.add_arguments(parser)
        buf = io.StringIO()
        assert Show.run(parser.parse_args([str(data[0]), "--index", str(index), *flags]), out=buf) == 0
        return buf.getvalue()

    plain, forced = run(), run("--color")
    assert "\x1b[" not in plain and TARGET_OPEN in plain
    assert "\x1b[32m" in forced and TARGET_OPEN not in forced
    assert re.sub(r"\x1b\[\d+m", "", forced.split("\n\n", 1)[1]) == plain.split("\n\n", 1)[1].replace(TARGET_OPEN, "").replace(TARGET_CLOSE, "")
    assert "\x1b[" not in run("--no-color")


def test_show_uid_equals_index_and_errors(data, capsys):
    index, sample, _ = _pick_sample(data)
    by_index = _cli(capsys, "show", str(data[0]), "--index", str(index))
    by_uid = _cli(capsys, "show", str(data[0]), "--uid", sample["sample_uid"])
    assert by_index[0] == by_uid[0] == 0 and by_index[1] == by_uid[1]
    code, out, err = _cli(capsys, "show", str(data[0]), "--uid", "no-such-uid")
    assert code == 2 and "no sample with sample_uid 'no-such-uid'" in err and out == ""
    code, _, err = _cli(capsys, "show", str(data[0]), "--index", str(ROWS))
    assert code == 2 and f"--index {ROWS} out of range" in err
    assert _cli(capsys, "show", str(data[0]), "--index", "-1")[0] == 0


def test_show_refuses_a_manifest_whose_earlier_shard_count_is_wrong(data, tmp_path, capsys):
    """An index in the last shard goes through the counts of the shards before it: one wrong
    count there is refused, not answered with the neighbouring sample."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data[0], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = _cli(capsys, "show", str(copy), "--index", "-1")
    assert code == 2 and out == "" and "row_count" in err and "the manifest says" in err, err


def test_show_tokens_table(data, capsys):
    index, sample, _ = _pick_sample(data)
    code, text, _ = _cli(capsys, "show", str(data[0]), "--index", str(index), "--tokens")
    assert code == 0
    table = text.split("\n\n", 1)[1].rstrip("\n").splitlines()
    ids = sample["input_ids"]
    pads = int(np.count_nonzero(ids == 151655))
    images = len(sample["image_grid_thw"])
    assert table[0].split() == ["index", "id", "mask", "t", "h", "w", "token"]
    assert len(table) - 1 == len(ids) - pads + images  # each image's pad run is one line
    first = table[1].split()
    assert first[:2] == ["0", str(ids[0])] and first[-1] == "'<|im_start|>'"
    pad_lines = [line for line in table if "'<|image_pad|>' x" in line]
    assert len(pad_lines) == images
    targets = [line for line in table[1:] if line.split()[2] == "1"]
    assert len(targets) == int(sample["loss_mask"].sum())


def test_show_save_images_rebuilds_stored_pixels(data, tmp_path, capsys):
    index, sample, _ = _pick_sample(data)
    out_dir = tmp_path / "images"
    code, text, _ = _cli(capsys, "show", str(data[0]), "--index", str(index), "--save-images", str(out_dir))
    assert code == 0
    grid = sample["image_grid_thw"]
    ends = np.cumsum(grid.prod(axis=1))
    for k, (t, h, w) in enumerate(grid.tolist()):
        path = out_dir / f"sample-{index:06d}-image-{k}.png"
        assert str(path) in text
        saved = Image.open(path)
        assert saved.size == (w * 16, h * 16) and saved.mode == "RGB"
        expected = patches_to_image(sample["pixel_patches"][ends[k] - t * h * w : ends[k]], (t, h, w), 16, 2)
        np.testing.assert_array_equal(np.asarray(saved), expected)


def test_show_tokenizer_checks(data, tmp_path, capsys):
    out, _ = data
    index, _, _ = _pick_sample(data)
    reference = _cli(capsys, "show", str(out), "--index", str(index))[1]
    # --model DIR with the same tokenizer.json gives the same text
    assert _cli(capsys, "show", str(out), "--index", str(index), "--model", str(bundled_tokenizer_dir()))[1] == reference
    # a manifest recording another tokenizer: clear refusal
    other = tmp_path / "other"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("_parts"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["profile"]["tokenizer_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _cli(capsys, "show", str(other), "--index", str(index))
    assert code == 2 and "tokenizer mismatch" in err and "--model DIR" in err
    code, _, err = _cli(capsys, "show", str(other), "--model", str(tmp_path))
    assert code == 2 and "no tokenizer.json" in err
    # a built-in profile this vlmpack does not have: named once, with the way out
    manifest["profile"]["family"] = "qwen9"
    (other / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _cli(capsys, "show", str(other), "--index", str(index))
    assert code == 2 and err.count("\n") == 1 and "its built-in profile 'qwen9' is not one this vlmpack has" in err, err
    assert err.count("--model DIR") == 1, err


# ------------------------------------------------------------------------ the report in a browser


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (not in CI)")
def test_html_report_renders_in_headless_chromium(data, tmp_path, capsys):
    plots = tmp_path / "plots"
    assert _cli(capsys, "inspect", str(data[0]), "--plots", str(plots))[0] == 0
    shot = tmp_path / "shot.png"
    subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={shot}", "--window-size=1200,1600", (plots / "report.html").resolve().as_uri()],
        capture_output=True, timeout=120, check=False,
    )
    assert shot.is_file() and shot.read_bytes().startswith(PNG_MAGIC)
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (1600, 1200)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 50  # text, tables and the charts' blue bars, not a blank page
    chart_blue = np.all(np.abs(pixels.astype(int) - (0x3B, 0x7D, 0xD8)) < 12, axis=-1)
    assert chart_blue.sum() > 2000  # the embedded charts were decoded and drawn


@pytest.mark.parametrize("family", ["qwen3-vl", "qwen2.5-vl"])
def test_show_collapses_each_video_into_one_placeholder(family, tmp_path, capsys):
    """A video is one `<video k: t x h x w, N tokens, S s>` inside the template's own markers
    (on Qwen3-VL its timestamps, inner markers and pads all go into it); no pad is left."""
    rows = example_rows(4, seed=2, family=family, size_range=(32, 96), video_rows=1.0)
    out = tmp_path / "shards"
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", rows))], out=str(out),
                                    profile=family, workers=1, progress=False))
    shards = open_shards(out)
    for index in range(len(shards)):
        sample = shards[index]
        code, text, _ = _cli(capsys, "show", str(out), "--index", str(index))
        assert code == 0
        assert f"videos      {len(sample['video_grid_thw'])}" in text
        body = text.split("\n\n", 1)[1]
        for k, (t, h, w) in enumerate(sample["video_grid_thw"].tolist()):
            seconds = t * float(sample["second_per_grid_ts"][k])
            assert f"<|vision_start|><video {k}: {t} x {h} x {w}, {t * h * w // 4} tokens, {seconds:.1f} s><|vision_end|>" in body
        assert "<|video_pad|>" not in body and "seconds>" not in body
    code, text, _ = _cli(capsys, "show", str(out), "--index", "0", "--save-images", str(tmp_path / "imgs"))
    sample, p = shards[0], 16 if family == "qwen3-vl" else 14
    t, h, w = sample["video_grid_thw"][0].tolist()
    sheet = tmp_path / "imgs" / "sample-000000-video-0.png"
    assert code == 0 and f"saved video 0 (a sheet of its {2 * t} frames of {w * p} x {h * p} px): {sheet}" in text
    from PIL import Image

    cols = min(8, 2 * t)
    assert Image.open(sheet).size == (cols * w * p, -(-2 * t // cols) * h * p)


def test_inspect_counts_videos_frames_seconds_and_tokens(tmp_path, capsys):
    rows = example_rows(5, seed=4, size_range=(32, 96), video_rows=1.0)
    out = tmp_path / "shards"
    manifest = run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", rows))], out=str(out),
                                               workers=1, rows_per_shard=2, progress=False))
    shards = open_shards(out)
    grids = np.concatenate([shards[i]["video_grid_thw"] for i in range(len(shards))])
    seconds = np.concatenate([shards[i]["second_per_grid_ts"] for i in range(len(shards))])
    totals = inspect_shards(out)["totals"]
    assert totals["videos"] == len(grids) == 5
    assert totals["video_frames"] == int(grids[:, 0].sum()) * 2
    assert totals["video_tokens"] == int(grids.prod(axis=1).sum()) // 4
    assert totals["video_seconds"] == pytest.approx(float((grids[:, 0] * seconds).sum()))
    code, text, _ = _cli(capsys, "inspect", str(out))
    assert code == 0 and f"videos           5  {totals['video_frames']:,} frames" in text
    # bytes per visual token: the shard files' bytes over image and video tokens, the same in
    # preprocess's summary and in inspect, each saying what it counts
    assert totals["bytes_per_visual_token"] == pytest.approx(totals["bytes"] / (totals["visual_tokens"] + totals["video_tokens"]))
    assert totals["pixel_bytes_per_visual_token"] == pytest.approx(
        (totals["patches"] * 768 + totals["video_patches"] * 2 * 768) / (totals["visual_tokens"] + totals["video_tokens"]))
    from preprocess.cli import format_summary

    summary = re.search(r"^bytes/visual token: (.*)$", format_summary(manifest, out), re.M).group(1)
    assert re.search(r"^bytes/visual tok (.*)$", text, re.M).group(1) == summary
    assert summary.startswith(f"{totals['bytes_per_visual_token']:,.0f} (shard files' bytes over the image and video tokens; "
                              f"pixels alone {totals['pixel_bytes_per_visual_token']:,.0f}); HF float32 pixel_values 24,576")


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["preprocess", "--help"],
    ["inspect", "{d}"],
    ["inspect", "{d}", "--json"],
    ["show", "{d}", "--tokens"],
    ["verify", "{d}"],
    ["train", "--dry-run", "--arch", "qwen3-vl-2b"],
], ids=lambda argv: " ".join(argv))
def test_output_into_a_closed_pipe_stops_quietly_with_exit_141(argv, data):
    """`vlmpack ... | head`: the reader is gone before the command writes; every command, help
    included, ends with 128 + SIGPIPE and no traceback (the dispatcher's one rule)."""
    argv = [a.format(d=data[0]) for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "shards_schema.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[1])
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("argv", [["inspect"], ["show"], ["pack", "--seq-len", "512"], ["export", "--out", "TMP/tars"]])
def test_a_store_url_given_to_a_local_shard_command_says_to_fetch_it_first(argv, tmp_path, capsys):
    """Path() folds `s3://b/x` into `s3:/b/x`: the command named that and said no such directory."""
    from shards_schema.cli import main

    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    assert main([argv[0], "s3://bucket/shards", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ("error: s3://bucket/shards is an object-store URL: this command reads a local shard directory; bring it "
            "down first (`vlmpack fetch s3://bucket/shards DIR`)") in err, err


def test_video_seconds_are_reported_without_float32_digits():
    """Seconds per temporal patch are stored as float32 (0.7 is 0.699999988...): the total reads
    3.5 s, not 3.4999998807907104."""
    from shards_schema.inspect import _video_totals

    class Shard:
        def list_values(self, column):
            return {"video_grid_thw": np.array([5, 2, 2], np.int32),
                    "second_per_grid_ts": np.array([0.7], np.float32)}[column]

    class Shards:
        shard_files = ["shard-000000.arrow"]

        def shard(self, k):
            return Shard()

    totals = _video_totals(Shards(), {"videos": 1, "video_patches": 20}, merge_area=4, temporal_patch_size=2)
    assert totals["video_seconds"] == 3.5 and totals["video_frames"] == 10 and totals["video_tokens"] == 5
