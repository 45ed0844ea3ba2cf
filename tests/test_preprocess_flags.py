"""`vlmpack preprocess`'s flags are generated from PreprocessConfig's fields (shards_schema.flags):
each flag sets its own field, and nothing else, to the value it parses to."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

import preprocess.cli as preprocess_cli
from preprocess.job import MAX_WORKERS, PreprocessConfig
from preprocess.pipeline import SampleOptions
from shards_schema.cli import main
from shards_schema.flags import add_flags, config_from_args, nested, setting
from shards_schema.storage import FetchPolicy

# flag and its value on the command line -> the config field it sets (a path) and that field's value
FLAG_VALUES = [
    (["--input-format", "sharegpt"], ("input_format",), "sharegpt"),
    (["--profile", "qwen2.5-vl"], ("profile",), "qwen2.5-vl"),
    (["--model", "models/qwen"], ("model",), "models/qwen"),
    (["--min-pixels", "3136"], ("min_pixels",), 3136),
    (["--max-pixels", "50176"], ("max_pixels",), 50176),
    (["--max-seq-len", "777"], ("sample", "max_seq_len"), 777),
    (["--truncate"], ("sample", "truncate"), True),
    (["--loss-policy", "last_assistant"], ("sample", "loss_policy"), "last_assistant"),
    (["--reasoning-loss", "mask"], ("sample", "reasoning_loss"), "mask"),
    (["--add-vision-id"], ("sample", "add_vision_id"), True),
    (["--preserve-thinking"], ("sample", "preserve_thinking"), True),
    (["--media-root", "media"], ("sample", "media_root"), "media"),
    (["--allow-remote-media"], ("sample", "allow_remote_media"), True),
    (["--max-image-pixels", "1000"], ("sample", "max_image_pixels"), 1000),
    (["--max-media-bytes", "4096"], ("sample", "max_media_bytes"), 4096),
    (["--max-row-bytes", "8192"], ("sample", "max_row_bytes"), 8192),
    # the remote flags act only with --allow-remote-media (alone they are refused), which `PARTNERS` sets too
    (["--remote-timeout", "2.5", "--allow-remote-media"], ("sample", "remote_fetch", "timeout"), 2.5),
    (["--remote-retries", "5", "--allow-remote-media"], ("sample", "remote_fetch", "retries"), 5),
    (["--video-sampling", "qwen-vl-utils"], ("sample", "video", "sampling"), "qwen-vl-utils"),
    (["--video-pixel-cap"], ("sample", "video", "cap_pixels_per_frame"), True),
    (["--video-fps", "1.5"], ("sample", "video", "fps"), 1.5),
    (["--video-max-frames", "9"], ("sample", "video", "max_frames"), 9),
    (["--video-max-pixels", "10000"], ("sample", "video", "max_pixels"), 10000),
    (["--video-total-pixels", "20000"], ("sample", "video", "total_pixels"), 20000),
    (["--video-fit"], ("sample", "video_fit"), True),
    (["--max-video-bytes", "123456"], ("sample", "max_video_bytes"), 123456),
    (["--workers", "3"], ("workers",), 3),
    (["--rows-per-shard", "13"], ("rows_per_shard",), 13),
    # the two partition flags come together (a lone one is refused); the other holds its default
    (["--num-partitions", "4", "--partition-index", "0"], ("num_partitions",), 4),
    (["--partition-index", "2", "--num-partitions", "1"], ("partition_index",), 2),
    (["--input-hash", "full"], ("input_hash",), "full"),
    (["--stage-dir", "stage"], ("stage_dir",), "stage"),
    (["--executor", "ray"], ("executor",), "ray"),
    (["--ray-address", "head:6379"], ("ray_address",), "head:6379"),
    (["--ray-max-retries", "7", "--executor", "ray"], ("ray_max_retries",), 7),
    (["--no-progress"], ("progress",), False),
]
REQUIRED = ["rows.jsonl", "more.jsonl", "--out", "shards"]
# flags given with the one they act only with: that one's field and value
PARTNERS = {
    "--remote-timeout": (("sample", "allow_remote_media"), True),
    "--remote-retries": (("sample", "allow_remote_media"), True),
    "--ray-max-retries": (("executor",), "ray"),
}


def _defaults() -> PreprocessConfig:
    """What `vlmpack preprocess rows.jsonl more.jsonl --out shards` runs."""
    return PreprocessConfig(inputs=["rows.jsonl", "more.jsonl"], out="shards",
                            workers=min(os.cpu_count() or 1, MAX_WORKERS), sample=SampleOptions())


def _with(obj, path: tuple, value):
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    return dataclasses.replace(obj, **{path[0]: _with(getattr(obj, path[0]), path[1:], value)})


def _parsed(monkeypatch, argv: list[str]) -> PreprocessConfig:
    """The config `vlmpack preprocess ARGV` hands to the job (the job itself not run)."""
    seen = []

    def capture(cfg):
        seen.append(cfg)
        return {"partition": "0/1", "units": 0, "rows_read": 0, "rows_rejected": 0, "_run": {"units_redone": []}}

    monkeypatch.setattr(preprocess_cli, "run_preprocess", capture)
    assert main(["preprocess", *argv]) == 0
    (cfg,) = seen
    return cfg


def test_without_flags_the_config_holds_the_defaults(monkeypatch, capsys):
    assert _parsed(monkeypatch, REQUIRED) == _defaults()


@pytest.mark.parametrize("argv, path, value", FLAG_VALUES, ids=[argv[0] for argv, _, _ in FLAG_VALUES])
def test_each_flag_sets_its_own_field_and_nothing_else(monkeypatch, capsys, argv, path, value):
    expected = _with(_defaults(), path, value)
    if argv[0] in PARTNERS:
        expected = _with(expected, *PARTNERS[argv[0]])
    assert _parsed(monkeypatch, [*REQUIRED, *argv]) == expected


def test_every_flag_of_the_command_is_in_the_table():
    parser = argparse.ArgumentParser()
    preprocess_cli.Preprocess.add_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings} - {"-h", "--help", "--out"}
    assert flags == {argv[0] for argv, _, _ in FLAG_VALUES}


@dataclasses.dataclass(kw_only=True)
class _Inner:
    depth: int = setting(1, type=int, help="inner depth")
    kept: str = "kept"  # no flag: always its default


@dataclasses.dataclass(kw_only=True)
class _Outer:
    names: list[str] = setting(name="names", nargs="+", help="positional names")
    level: int = setting(2, group="levels", type=int, flag_default=5, help="level (default %(default)s)")
    inner: _Inner = nested(default_factory=_Inner, prefix="inner_")
    fetch: FetchPolicy = nested(FetchPolicy(), prefix="fetch_", flags={
        "retries": setting(help="retries", type=int).metadata["flag"]})


def test_flags_follow_fields_prefixes_and_the_command_lines_own_defaults():
    parser = argparse.ArgumentParser(prog="x")
    add_flags(parser, _Outer)
    assert [a.dest for a in parser._actions] == ["help", "names", "level", "inner_depth", "fetch_retries"]
    assert [g.title for g in parser._action_groups][-1] == "levels"
    assert "level (default 5)" in parser.format_help()
    parsed = config_from_args(_Outer, parser.parse_args(["a", "b", "--inner-depth", "3", "--fetch-retries", "0"]))
    assert parsed == _Outer(names=["a", "b"], level=5, inner=_Inner(depth=3), fetch=FetchPolicy(retries=0))
    assert parsed.inner.kept == "kept" and parsed.fetch.backoff == FetchPolicy.backoff


@pytest.mark.parametrize("argv, message", [
    (["--num-partitions", "4"], "--num-partitions 4 needs --partition-index: give each machine its own "
                                "--partition-index, 0 to 3"),
    (["--partition-index", "0"], "--partition-index 0 needs --num-partitions"),
    (["--num-partitions", "2", "--partition-index", "2"], "--partition-index must be in 0..1 (--num-partitions 2), "
                                                          "got 2"),
    (["--ray-address", "head:6379"], "--ray-address head:6379 joins a Ray cluster for --executor ray: add "
                                     "--executor ray, or drop --ray-address"),
    (["--ray-max-retries", "5", "--executor", "local"], "--ray-max-retries 5 sets how often Ray re-runs a task of "
                                                        "--executor ray: add --executor ray, or drop --ray-max-retries"),
    (["--remote-timeout", "3"], "--remote-timeout 3.0 times fetches of media URLs, which only --allow-remote-media "
                                "makes: add --allow-remote-media, or drop --remote-timeout"),
    (["--remote-retries", "0"], "--remote-retries 0 retries fetches of media URLs, which only --allow-remote-media "
                                "makes: add --allow-remote-media, or drop --remote-retries"),
    (["--stage-dir", "s3://data/stage"], "--stage-dir s3://data/stage is a URL: the job runs in a local directory "
                                         "before its upload to --out; give a local path"),
    (["--stage-dir", "stage"], "--stage-dir stage is where a job whose --out is on an object store runs before its "
                               "upload; --out "),
    (["--video-sampling", "qwen-vl-utils", "--video-pixel-cap"],
     "--video-pixel-cap caps frames of --video-sampling hf; qwen-vl-utils sampling always caps each frame's pixels "
     "itself, so the flag would change nothing: drop --video-pixel-cap"),
], ids=["count-alone", "index-alone", "index-out-of-range", "ray-address-without-ray", "ray-retries-without-ray",
        "remote-timeout-without-remote-media", "remote-retries-without-remote-media", "stage-dir-a-url",
        "stage-dir-with-a-local-out", "pixel-cap-with-qwen-vl-utils-sampling"])
def test_a_flag_without_its_partner_or_out_of_range_is_refused_before_any_work(tmp_path, capsys, argv,
                                                                                        message):
    out = tmp_path / "out"
    assert main(["preprocess", str(tmp_path / "rows.jsonl"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists() and not os.path.exists("s3:")


@pytest.mark.parametrize("profile, refused", [("qwen3-vl", True), ("qwen2.5-vl", True), ("qwen3-vl-thinking", False)])
def test_reasoning_loss_mask_with_a_template_that_renders_no_reasoning_is_refused(tmp_path, capsys, profile, refused):
    """--reasoning-loss acts on Thinking templates only: where the template renders no reasoning
    it would be silently ignored, so it is refused before any work."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}\n')
    out = tmp_path / "out"
    code = main(["preprocess", str(rows), "--out", str(out), "--profile", profile, "--reasoning-loss", "mask",
                 "--no-progress"])
    err = capsys.readouterr().err
    if refused:
        assert code == 2 and err.count("\n") == 1, err
        assert "--reasoning-loss mask: the instruct template renders no reasoning" in err, err
        assert not out.exists()
    else:
        assert code == 0, err


def test_a_video_max_frames_under_two_is_refused_naming_the_flag(tmp_path, capsys):
    """Frames are cut in pairs: --video-max-frames 1 would reject every video row."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["preprocess", str(tmp_path / "rows.jsonl"), "--out", str(out), "--video-max-frames", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "argument --video-max-frames: must be at least 2 (a video's frames are cut in pairs), got 1" in err
    assert not out.exists()


def test_one_partition_needs_no_index(monkeypatch, capsys):
    assert _parsed(monkeypatch, [*REQUIRED, "--num-partitions", "1"]) == _defaults()
