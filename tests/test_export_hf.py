"""`vlmpack export-hf` writes a complete Hugging Face directory.

Shard manifests record the chat template's text in the profile, without changing the
profile's fingerprint id. A training save keeps the preprocessing profile of its shards
(`profile.json`: the chat template's text, the image and video processor settings). Its export loads with
`AutoProcessor.from_pretrained` and gives exactly what preprocessing gave: the token ids of
`apply_chat_template` and of the processor's own call, image and video grids, video pixels, and
with the PIL image processor the image pixels bit for bit, for both families and the Thinking
template, with the profile's settings winning over the files kept from the source checkpoint.
Profiles recorded before they held the template's text, and models with no profile at all,
still export, saying in one line what is missing and how to give it. A LoRA run on a random
init exports its base, onto which PEFT loads the exported adapters with the run's logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from preprocess.examples import encode_data_uri, synthetic_image
from preprocess.pipeline import SampleOptions, process_row
from preprocess.profiles import OFFICIAL_TEMPLATE_SHA256, builtin_profile
from shards_schema.builtin import BUILTIN_CHAT_TEMPLATES, BUILTIN_VISION, CHAT_TEMPLATE_DIR, builtin_chat_template
from shards_schema.cli import main as vlmpack
from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches
from tests.conftest import FIXTURES_DIR
from tests.helpers.models import tiny_qwen2_5_vl, tiny_qwen3_vl
from tests.helpers.render import hf_template_messages
from tests.helpers.shards import preprocess
from tests.helpers.train import BASE
from tests.helpers.video import random_video_row
from train import convert
from train.checkpoint_format import image_processor_config, read_profile, write_profile

# built-in profile -> (tiny HF model of its family, the family)
PROFILES = {"qwen3-vl": (tiny_qwen3_vl, "qwen3-vl"), "qwen2.5-vl": (tiny_qwen2_5_vl, "qwen2.5-vl"),
            "qwen3-vl-thinking": (tiny_qwen3_vl, "qwen3-vl")}


def manifest_profile(profile) -> dict:
    """The profile as a shard manifest records it (JSON, as preprocessing writes it)."""
    return json.loads(json.dumps(profile.fingerprint))


def test_bundled_templates_are_the_official_ones_and_their_text_leaves_the_fingerprint_id_alone():
    for name, file in BUILTIN_CHAT_TEMPLATES.items():
        assert (CHAT_TEMPLATE_DIR / file).read_bytes() == (FIXTURES_DIR / file).read_bytes()
        profile = builtin_profile(name)
        recorded = manifest_profile(profile)
        assert recorded["chat_template"] == builtin_chat_template(name)
        assert hashlib.sha256(recorded["chat_template"].encode()).hexdigest() == recorded["chat_template_sha256"] \
            == OFFICIAL_TEMPLATE_SHA256[name]
    # the id hashes the template's sha256, not its text: the ids of data made before the text
    # was recorded stay what they were
    assert dataclasses.replace(profile, chat_template="other").fingerprint["id"] == recorded["id"]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """family -> a tiny HF checkpoint directory carrying the family's published image-processor
    settings and another chat template than the profiles under test: what import-hf keeps of it
    must give way to the training data's profile."""
    out = {}
    for make, family in PROFILES.values():
        if family in out:
            continue
        path = tmp_path_factory.mktemp(f"hf-{family}")
        make(seed=1).save_pretrained(path)
        published = image_processor_config(family, dataclasses.asdict(BUILTIN_VISION[family]))
        other_template = "{{ messages[0]['content'] }}"
        (path / "preprocessor_config.json").write_text(json.dumps(published))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": other_template}))
        # transformers 5 saves processors nested in processor_config.json, which it reads first
        (path / "processor_config.json").write_text(json.dumps({"image_processor": published,
                                                                "chat_template": other_template}))
        out[family] = path
    return out


def _image_row(nprng, family: str):
    """A conversation with two images: (vlmpack row, HF messages with the images as PIL)."""
    images = [synthetic_image(nprng, int(w), int(h)) for w, h in nprng.integers(40, 300, (2, 2))]
    ours = [{"type": "image_url", "image_url": {"url": encode_data_uri(img, "PNG")}} for img in images]
    theirs = [{"type": "image", "image": img} for img in images]
    text = {"type": "text", "text": "Compare them."}
    answer = {"role": "assistant", "content": "The first is brighter."}
    return ({"messages": [{"role": "user", "content": [*ours, text]}, answer]},
            [{"role": "user", "content": [*theirs, text]}, answer])


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_export_processes_like_the_training_data(name, hf_checkpoints, tmp_path):
    from transformers import AutoImageProcessor, AutoProcessor

    _, family = PROFILES[name]
    # pixel bounds the checkpoint's own files do not have: the profile's settings must win
    profile = builtin_profile(name).with_pixel_bounds(min_pixels=64 * 64, max_pixels=160 * 160)
    convert.import_hf(hf_checkpoints[family], tmp_path / "model")
    write_profile(tmp_path / "model", manifest_profile(profile))
    _, side_files = convert.export_hf(tmp_path / "model", tmp_path / "hf")
    assert side_files.notes == []
    assert {"tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json",
            "generation_config.json"} <= set(side_files.written)
    assert not (tmp_path / "hf" / "chat_template.json").exists()

    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert processor.chat_template == profile.chat_template
    media = tmp_path / "media"
    media.mkdir()
    options = SampleOptions(media_root=str(media), max_seq_len=1 << 20)
    rng, nprng = random.Random(name), np.random.default_rng(11)
    v = profile.vision

    # apply_chat_template(tokenize=True) on a conversation with images: the token ids and grids
    row, messages = _image_row(nprng, family)
    sample = process_row(row, sample_uid="images", source="x", profile=profile, options=options)
    hf = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert hf["input_ids"][0].tolist() == sample.input_ids.tolist()
    assert hf["image_grid_thw"].tolist() == sample.image_grid_thw.tolist()
    # and with the PIL image processor the pixels too (torchvision's resize differs by a level or two)
    processor.image_processor = AutoImageProcessor.from_pretrained(tmp_path / "hf", backend="pil")
    hf = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert hf["input_ids"][0].tolist() == sample.input_ids.tolist()
    pixels = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size,
                                       v.temporal_patch_size)
    assert np.array_equal(np.asarray(hf["pixel_values"]), pixels)

    # the processor's call on conversations with videos (and images): ids, grids, pixels
    for n in range(2):
        row, messages, videos, metadata, images = random_video_row(rng, nprng, media, family)
        sample = process_row(row, sample_uid=f"r{n}", source="x", profile=profile, options=options)
        text = processor.apply_chat_template(hf_template_messages(messages), tokenize=False)
        hf = processor(text=[text], images=images or None, videos=videos, video_metadata=metadata,
                       return_tensors="pt")
        assert hf["input_ids"][0].tolist() == sample.input_ids.tolist(), n
        assert hf["video_grid_thw"].tolist() == sample.video_grid_thw.tolist()
        video = profile.video
        assert np.array_equal(hf["pixel_values_videos"].numpy(),
                              video_pixel_values_from_patches(sample.video_patches, video.image_mean, video.image_std))
        if images:
            assert hf["image_grid_thw"].tolist() == sample.image_grid_thw.tolist()
            pixels = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size,
                                               v.temporal_patch_size)
            assert np.array_equal(np.asarray(hf["pixel_values"]), pixels)


@pytest.fixture(scope="module")
def random_init_model(tmp_path_factory) -> Path:
    """A model directory of the tiny random-init architecture (no files of a HF checkpoint)."""
    from train.model.arch import builtin_arch

    arch = builtin_arch("tiny")
    torch.manual_seed(0)
    full = {k: torch.randn(s) for k, s in convert.megatron_shapes(arch).items()}
    path = tmp_path_factory.mktemp("random-init") / "model"
    convert.save_model_dir(path, {(0, 0): convert.shard(full, arch, 1, 0, 1, 0)}, arch, 1, 1)
    return path


def notes(capsys) -> list[str]:
    """The lines `vlmpack` printed to stderr (not the progress bars)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlmpack")]


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_profile_recorded_without_the_template_text_still_exports(random_init_model, tmp_path, capsys):
    recorded = manifest_profile(builtin_profile("qwen3-vl-thinking"))
    del recorded["chat_template"]  # what shards preprocessed by an earlier vlmpack record
    model = _copy_model(random_init_model, tmp_path / "old")
    write_profile(model, recorded)
    # a built-in template is known by its sha256
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "builtin")]) == 0
    assert notes(capsys) == []
    assert (tmp_path / "builtin" / "chat_template.jinja").read_bytes() == \
        (FIXTURES_DIR / "qwen3_vl_thinking.chat_template.jinja").read_bytes()

    # another template (a --model DIR's) cannot be: one line says so, the rest is written
    write_profile(model, {**recorded, "chat_template_sha256": "0" * 64, "source": "/models/custom"})
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "unknown")]) == 0
    err = notes(capsys)
    assert len(err) == 1 and err[0].startswith("vlmpack export-hf: note: the training data's profile records no chat "
                                               "template text"), err
    assert "pass --chat-template FILE" in err[0] and "/models/custom" in err[0]
    assert not (tmp_path / "unknown" / "chat_template.jinja").exists()
    assert {"tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json"} <= \
        {p.name for p in (tmp_path / "unknown").iterdir()}
    # --chat-template FILE gives it
    template = tmp_path / "custom.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "given"), "--chat-template", str(template)]) == 0
    assert notes(capsys) == []
    assert (tmp_path / "given" / "chat_template.jinja").read_text() == template.read_text()


def test_a_model_without_profile_or_template_exports_with_a_note_naming_the_option(random_init_model, tmp_path,
                                                                                  capsys):
    from transformers import AutoProcessor

    assert read_profile(random_init_model) is None
    assert vlmpack(["export-hf", str(random_init_model), "--out", str(tmp_path / "hf")]) == 0
    err = notes(capsys)
    assert len(err) == 1 and "no chat template" in err[0] and "pass --chat-template FILE" in err[0], err
    template = tmp_path / "t.jinja"
    template.write_text(builtin_chat_template("qwen3-vl"))
    assert vlmpack(["export-hf", str(random_init_model), "--out", str(tmp_path / "hf"), "--overwrite",
                    "--chat-template", str(template)]) == 0
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    ids = processor.apply_chat_template(messages, tokenize=True)
    assert ids[0][:3] == [151644, 872, 198]  # <|im_start|>user\n
    # without a profile the family's published video processor is written too: transformers would
    # otherwise fall back to another class, with the image processor's size bounds
    video = processor.video_processor
    assert type(video).__name__ == "Qwen3VLVideoProcessor", type(video)
    assert (video.size["shortest_edge"], video.size["longest_edge"]) == (4096, 25165824), video.size


def test_the_shards_own_tokenizer_comes_from_their_model_dir_or_is_named(random_init_model, tmp_path, capsys):
    """Shards made with `preprocess --model DIR` and another tokenizer than the built-in one: a
    model without tokenizer files of its own gets DIR's, or a note naming it when it is gone."""
    from shards_schema.builtin import builtin_tokenizer_json

    other = builtin_tokenizer_json("qwen2.5-vl")  # not the built-in qwen3-vl tokenizer
    source = tmp_path / "Qwen-VL-custom"
    source.mkdir()
    (source / "tokenizer.json").write_text(other, encoding="utf-8")
    recorded = {**manifest_profile(builtin_profile("qwen3-vl")), "source": str(source),
                "tokenizer_sha256": hashlib.sha256(other.encode()).hexdigest()}
    model = _copy_model(random_init_model, tmp_path / "model")
    write_profile(model, recorded)
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "hf")]) == 0
    assert notes(capsys) == []
    assert (tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8") == other
    (source / "tokenizer.json").unlink()
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "hf"), "--overwrite"]) == 0
    err = notes(capsys)
    assert len(err) == 1 and f"tokenized with the tokenizer of {source}" in err[0], err
    assert (tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8") == builtin_tokenizer_json("qwen3-vl")


# --- LoRA on a random init: its base, exported, carries the PEFT adapters -------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return preprocess(tmp_path_factory.mktemp("lora-base-data"), "shards", rows=12)


def test_lora_run_on_a_random_init_exports_its_base_and_peft_loads_the_adapters_onto_it(shards, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    peft = pytest.importorskip("peft")
    from shards_schema import open_shards
    from tests.helpers.parity import TOLERANCE, hf_inputs, our_forward, our_model, pick, real_rows
    from train import adapter_format
    from train.packed_batch import assemble_pack
    from train.parallel import destroy_parallel, init_parallel

    out = tmp_path / "run"
    # one step of one pack, at a learning rate that moves the adapters well off zero (later flags win)
    assert vlmpack(["train", *BASE, "--global-batch-packs", "1", "--warmup-steps", "0", "--lr", "3e-2", "--data",
                    str(shards), "--out", str(out), "--train-steps", "1", "--lora-rank", "4"]) == 0
    step = out / "checkpoints" / "step_00000001"
    assert read_profile(step / "adapter") == open_shards(shards).manifest["profile"]
    assert vlmpack(["export-hf", str(step), "--lora-format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    assert vlmpack(["export-hf", str(step), "--lora-base", "--out", str(tmp_path / "base")]) == 0
    assert (tmp_path / "base" / "chat_template.jinja").read_text() == builtin_chat_template("qwen3-vl")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    for flags, message in ((["--lora-base", "--merge"], "not --merge and --lora-base"),
                           (["--chat-template", str(template)], "a PEFT adapter directory holds no chat template")):
        assert vlmpack(["export-hf", str(step), *flags, "--out", str(tmp_path / "refused")]) == 2
        err = notes(capsys)
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "refused").exists()

    data = open_shards(shards)
    pack = assemble_pack(pick(data, "mixed"), pad_to_multiple=8, seq_len=None)
    rows = real_rows(pack)
    base = AutoModelForImageTextToText.from_pretrained(tmp_path / "base").eval()
    inner = AutoModelForImageTextToText.from_pretrained(tmp_path / "base")
    with_adapter = peft.PeftModel.from_pretrained(inner, tmp_path / "adapter").eval()
    _, spec, arch, adapters = adapter_format.read_adapter_dir(step / "adapter")
    info = init_parallel(1, 1, device="cpu")
    try:
        model, _ = our_model(base.state_dict(), arch, spec, adapters, info)
        with torch.no_grad():
            ours = our_forward(model, data, pack, logits=True)
            theirs = with_adapter(**hf_inputs(inner, data, pack)).logits[0]
            plain = base(**hf_inputs(base, data, pack)).logits[0]
    finally:
        destroy_parallel()
    assert (ours[rows] - theirs[rows]).abs().max() < TOLERANCE
    assert (plain[rows] - theirs[rows]).abs().max() > 1e2 * TOLERANCE  # the trained adapters change the model



def test_another_familys_official_template_is_refused_and_a_template_of_ones_own_is_taken(random_init_model,
                                                                                         tmp_path, capsys):
    other = tmp_path / "qwen3_5.jinja"
    other.write_text(builtin_chat_template("qwen3.5"))
    out = tmp_path / "hf"
    assert vlmpack(["export-hf", str(random_init_model), "--out", str(out), "--chat-template", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {other} is the official qwen3.5 chat template, and the model is a qwen3-vl model" in err
    assert not out.exists()
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert vlmpack(["export-hf", str(random_init_model), "--out", str(out), "--chat-template", str(own)]) == 0
    assert (out / "chat_template.jinja").read_text() == own.read_text()
