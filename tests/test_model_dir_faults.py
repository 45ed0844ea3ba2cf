"""`vlmpack preprocess --model DIR` with a damaged or inconsistent checkpoint directory: every
fault is one line naming the file (and field) and the fix, exit 2, before any output exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preprocess.errors import ConfigError
from preprocess.examples import write_jsonl
from preprocess.profiles import profile_from_model_dir, resolve_profile
from shards_schema.cli import main
from tests.helpers.model_dirs import qwen3_vl_model_dir


@pytest.fixture
def model(tmp_path, official_template) -> Path:
    """A valid Qwen3-VL checkpoint directory without weights (config, tokenizer, processor, template)."""
    return qwen3_vl_model_dir(tmp_path, official_template)


def _preprocess(capsys, tmp_path: Path, model: Path, *flags: str) -> tuple[int, str]:
    """`vlmpack preprocess ROWS --model MODEL FLAGS` in this process: (exit code, stderr)."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}])
    code = main(["preprocess", str(rows), "--out", str(tmp_path / "out"), "--model", str(model), "--workers", "1",
                 "--no-progress", *flags])
    return code, capsys.readouterr().err


def _refused(capsys, tmp_path: Path, model: Path, *flags: str) -> str:
    """The one-line refusal of the job; nothing written."""
    code, err = _preprocess(capsys, tmp_path, model, *flags)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("vlmpack preprocess: error: "), err
    assert not (tmp_path / "out").exists()
    return err


def _update(path: Path, **values) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(values)
    path.write_text(json.dumps(cfg))


NOT_A_JSON_OBJECT = [("{", "not valid JSON"), ("[]", "holds a JSON array, not an object")]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                                  "video_preprocessor_config.json", "chat_template.json"])
@pytest.mark.parametrize("text, problem", NOT_A_JSON_OBJECT, ids=["not-json", "array"])
def test_a_model_file_that_is_not_a_json_object_is_refused_naming_the_file(capsys, tmp_path, model, name, text,
                                                                          problem):
    if name == "chat_template.json":
        (model / "chat_template.jinja").unlink()  # so that HF's order reaches chat_template.json
    (model / name).write_text(text)
    err = _refused(capsys, tmp_path, model)
    assert f"{model / name}: {problem}" in err and f"restore the checkpoint's own {name}" in err, err


@pytest.mark.parametrize("config, problem", [
    ({}, "has no model_type"),
    ({"model_type": ["qwen3_vl"]}, "model_type ['qwen3_vl'] is not a string"),
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
], ids=["missing", "not-a-string", "unknown"])
def test_a_config_json_without_a_supported_model_type_is_refused(capsys, tmp_path, model, config, problem):
    (model / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, tmp_path, model)
    assert f"{model / 'config.json'}: {problem}" in err and "qwen3_vl" in err, err


def test_a_tokenizer_json_the_tokenizers_library_rejects_is_refused_naming_the_file(capsys, tmp_path, model):
    (model / "tokenizer.json").write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    err = _refused(capsys, tmp_path, model)
    assert f"{model / 'tokenizer.json'}: the tokenizers library cannot load it" in err, err


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json"])
def test_a_model_text_file_that_is_not_utf8_is_refused_naming_the_file(capsys, tmp_path, model, name):
    (model / name).write_bytes(b"\xff\xfe not UTF-8")
    err = _refused(capsys, tmp_path, model)
    assert f"{model / name}: not UTF-8 text (byte 0)" in err, err


def test_a_missing_model_dir_or_a_model_file_that_is_a_directory_is_named_as_such(capsys, tmp_path, model):
    err = _refused(capsys, tmp_path, tmp_path / "nowhere")
    assert f"--model {tmp_path / 'nowhere'}: no such directory; pass a Hugging Face Qwen-VL checkpoint" in err, err
    tokenizer = (model / "tokenizer.json").read_bytes()
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").mkdir()
    err = _refused(capsys, tmp_path, model)
    assert f"--model {model}: tokenizer.json is not a file" in err, err
    (model / "tokenizer.json").rmdir()
    (model / "tokenizer.json").write_bytes(tokenizer)
    (model / "video_preprocessor_config.json").mkdir()
    err = _refused(capsys, tmp_path, model)
    assert f"{model / 'video_preprocessor_config.json'}: not a file" in err, err


@pytest.mark.parametrize("value, problem", [
    (42, "chat_template must be the template's text (a string), got 42"),
    ([{"name": "tool_use", "template": "{{ x }}"}, 7], "chat_template holds named templates ('tool_use') but "
                                                       "none named 'default', the one Hugging Face applies: save the "
                                                       "one to train with as chat_template.jinja beside it"),
], ids=["number", "named-templates"])
def test_a_tokenizer_config_chat_template_that_is_no_text_is_named(capsys, tmp_path, model, value, problem):
    (model / "chat_template.jinja").unlink()
    config = model / "tokenizer_config.json"
    if not config.exists():
        config.write_text("{}")
    _update(config, chat_template=value)
    err = _refused(capsys, tmp_path, model)
    assert f"{config}: {problem}" in err, err


def test_named_chat_templates_give_the_one_named_default_as_hugging_face_does(tmp_path, model):
    official = (model / "chat_template.jinja").read_text(encoding="utf-8")
    (model / "chat_template.jinja").unlink()
    config = model / "tokenizer_config.json"
    if not config.exists():
        config.write_text("{}")
    _update(config, chat_template=[{"name": "rag", "template": "{{ x }}"}, {"name": "default", "template": official}])
    assert profile_from_model_dir(model).chat_template == official
    # HF applies a `tool_use` template to rows with tools: two templates for one dataset
    _update(config, chat_template=[{"name": "tool_use", "template": "{{ x }}"}, {"name": "default", "template": official}])
    with pytest.raises(ConfigError, match="chat_template holds a 'tool_use' template beside 'default', and Hugging Face "
                                          "applies the first to rows with tools"):
        profile_from_model_dir(model)


def test_an_empty_chat_template_is_refused_naming_the_file(capsys, tmp_path, model):
    (model / "chat_template.jinja").write_text("\n")
    assert f"{model / 'chat_template.jinja'}: empty" in _refused(capsys, tmp_path, model)


PROCESSOR_FAULTS = [
    ("preprocessor_config.json", {"patch_size": 0}, "patch_size must be an integer from 1 to 256, got 0"),
    ("preprocessor_config.json", {"patch_size": "16"}, "patch_size must be an integer from 1 to 256, got '16'"),
    ("preprocessor_config.json", {"patch_size": 16.5}, "patch_size must be an integer from 1 to 256, got 16.5"),
    ("preprocessor_config.json", {"patch_size": float("inf")}, "patch_size must be an integer from 1 to 256, got inf"),
    ("preprocessor_config.json", {"merge_size": 0}, "merge_size must be an integer from 1 to 16, got 0"),
    ("preprocessor_config.json", {"merge_size": True}, "merge_size must be an integer from 1 to 16, got True"),
    ("preprocessor_config.json", {"temporal_patch_size": -1},
     "temporal_patch_size -1 is not supported: vlmpack cuts frames in pairs (temporal_patch_size 2"),
    ("preprocessor_config.json", {"temporal_patch_size": 1}, "temporal_patch_size 1 is not supported"),
    ("preprocessor_config.json", {"temporal_patch_size": 3}, "temporal_patch_size 3 is not supported"),
    ("preprocessor_config.json", {"image_std": [0.5, 0, 0.5]},
     "image_std must be a list of 3 finite numbers (one per RGB channel, none 0), got [0.5, 0, 0.5]"),
    ("preprocessor_config.json", {"image_std": [0.5, 0.5]}, "image_std must be a list of 3 finite numbers"),
    ("preprocessor_config.json", {"image_mean": [0.5] * 4}, "image_mean must be a list of 3 finite numbers"),
    ("preprocessor_config.json", {"image_mean": ["a", "b", "c"]}, "image_mean must be a list of 3 finite numbers"),
    ("preprocessor_config.json", {"image_mean": None}, "missing image-processor field image_mean"),
    ("preprocessor_config.json", {"size": {"shortest_edge": 4096, "longest_edge": 1024}},
     "size.shortest_edge 4096 is larger than size.longest_edge 1024: the image area bounds need min_pixels <= "
     "max_pixels"),
    ("preprocessor_config.json", {"min_pixels": 0}, "min_pixels must be an integer from 1 to 9007199254740992, got 0"),
    ("preprocessor_config.json", {"size": [1, 2]}, "size must be an object (shortest_edge, longest_edge)"),
    ("video_preprocessor_config.json", {"fps": 0}, "fps must be a number from 0.001 to 1000, got 0"),
    ("video_preprocessor_config.json", {"fps": 1e-9}, "fps must be a number from 0.001 to 1000, got 1e-09"),
    ("video_preprocessor_config.json", {"patch_size": 14},
     "patch_size 14 differs from patch_size 16 in preprocessor_config.json: vlmpack cuts video frames as the image "
     "processor cuts images"),
    ("video_preprocessor_config.json", {"merge_size": 4}, "merge_size 4 differs from merge_size 2"),
    ("video_preprocessor_config.json", {"temporal_patch_size": 16}, "temporal_patch_size 16 differs from "),
    ("video_preprocessor_config.json", {"min_frames": 8, "max_frames": 4},
     "max_frames must be an integer from 8 to 9007199254740992, got 4"),
    ("video_preprocessor_config.json", {"image_std": [0.5, 0.5, 0]}, "image_std must be a list of 3 finite numbers"),
    # fewer frames than a temporal patch would reject every video (as --video-max-frames 1 is refused)
    ("video_preprocessor_config.json", {"min_frames": 1, "max_frames": 1},
     "max_frames must be an integer from 2 to 9007199254740992, got 1"),
    # a processing step switched off, or another rescale, would make other pixels than vlmpack's
    ("preprocessor_config.json", {"do_resize": False}, "do_resize false is not supported"),
    ("preprocessor_config.json", {"do_normalize": False}, "do_normalize false is not supported"),
    ("preprocessor_config.json", {"do_convert_rgb": False}, "do_convert_rgb false is not supported"),
    ("preprocessor_config.json", {"rescale_factor": 0.5}, "rescale_factor 0.5 is not supported"),
    ("preprocessor_config.json", {"resample": 0}, "resample 0 is not supported: vlmpack resizes bicubic (resample 3)"),
    ("video_preprocessor_config.json", {"resample": 2}, "resample 2 is not supported"),
    ("video_preprocessor_config.json", {"do_rescale": False}, "do_rescale false is not supported"),
    ("video_preprocessor_config.json", {"max_video_tokens": 0}, "max_video_tokens must be an integer from 1"),
    ("config.json", {"vision_config": {"tokens_per_second": 0}},
     "vision_config.tokens_per_second must be an integer from 1 to 1000, got 0"),
    ("config.json", {"vision_config": [2]}, "vision_config must be an object, got [2]"),
]


@pytest.mark.parametrize("name, values, problem", PROCESSOR_FAULTS,
                         ids=[f"{name}:{','.join(f'{k}={v!r}' for k, v in values.items())}"
                              for name, values, _ in PROCESSOR_FAULTS])
def test_processor_values_out_of_range_are_refused_naming_the_file_and_field(capsys, tmp_path, model, name, values,
                                                                            problem):
    path = model / name
    if not path.exists():
        path.write_text("{}")
    _update(path, **values)
    err = _refused(capsys, tmp_path, model)
    assert f"{path}: {problem}" in err, err


@pytest.mark.parametrize("key, value, field", [("spatial_merge_size", 0, "merge_size"),
                                               ("patch_size", 14, "patch_size"),
                                               ("temporal_patch_size", 1, "temporal_patch_size")])
def test_a_config_json_vision_tower_that_cuts_images_otherwise_than_the_processor_is_refused(
        capsys, tmp_path, model, key, value, field):
    _update(model / "config.json", vision_config={key: value})
    err = _refused(capsys, tmp_path, model)
    assert f"{model / 'config.json'}: vision_config.{key} {value} differs from {field}" in err, err
    assert "preprocessor_config.json" in err


@pytest.mark.parametrize("model_type, family", [("qwen2_5_vl", "qwen2.5-vl"), ("qwen3_5", "qwen3.5")])
def test_a_model_type_whose_chat_template_is_another_familys_official_one_is_refused(capsys, tmp_path, model,
                                                                                     model_type, family):
    _update(model / "config.json", model_type=model_type)
    err = _refused(capsys, tmp_path, model)
    assert (f"config.json's model_type '{model_type}' is a {family} checkpoint, but chat_template.jinja holds the "
            "official qwen3-vl instruct chat template") in err, err


def test_null_processor_values_take_the_familys_published_ones(model):
    """HF processors read null as "not set": the family's value, as if the key were absent."""
    _update(model / "preprocessor_config.json", size=None, min_pixels=None)
    (model / "video_preprocessor_config.json").write_text(json.dumps({"fps": None, "max_frames": 100}))
    profile = profile_from_model_dir(model, check_template=False)
    builtin = resolve_profile("qwen3-vl")
    assert (profile.vision.min_pixels, profile.vision.max_pixels) == (builtin.vision.min_pixels,
                                                                      builtin.vision.max_pixels)
    assert (profile.video.fps, profile.video.max_frames) == (builtin.video.fps, 100)


def test_model_and_profile_together_are_refused_before_any_work(capsys, tmp_path, model):
    err = _refused(capsys, tmp_path, model, "--profile", "qwen3.6")
    assert f"--model {model} and --profile qwen3.6 both name the processing profile: give one" in err, err
    with pytest.raises(ConfigError, match="both name the processing profile"):
        resolve_profile("qwen3.6", model)


def test_a_qwen3_vl_moe_checkpoint_is_read_as_a_qwen3_vl_profile(model):
    """Qwen3-VL's Mixture-of-Experts checkpoints carry the dense ones' tokenizer, processor and
    templates: the same profile."""
    dense = profile_from_model_dir(model)
    _update(model / "config.json", model_type="qwen3_vl_moe")
    moe = profile_from_model_dir(model)
    assert moe.family == dense.family == "qwen3-vl" and moe.fingerprint == dense.fingerprint


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_template_file_that_is_no_regular_file_is_named_not_skipped(capsys, tmp_path, model, name):
    """A FIFO where the chat template is looked for would block a read, and skipping it would
    report the directory as having no template at all."""
    import os

    for candidate in ("chat_template.jinja", "chat_template.json", name):
        (model / candidate).unlink(missing_ok=True)
    os.mkfifo(model / name)
    err = _refused(capsys, tmp_path, model)
    assert f"{model / name}: not a regular file: restore the checkpoint's own {name}" in err, err
