"""End to end: every number of a preprocessed sample against Hugging Face's own processing of
the same row, for both families, over randomized conversations with real encoded images.

The HF side is what `Qwen*VLProcessor` does, step by step (the processor class itself needs
torchvision for its video processor): `apply_chat_template` with the official template ->
each `<|image_pad|>` repeated t*h*w/m^2 times -> tokenize; `Qwen2VLImageProcessorPil` on the
decoded image; `get_rope_index` of a tiny random HF model; assistant spans located from the
token ids alone.
"""

from __future__ import annotations

import base64
import io
import random

import numpy as np
import pytest
from PIL import Image, ImageOps

from preprocess.errors import RejectError
from preprocess.examples import synthetic_image
from preprocess.pipeline import SampleOptions, process_row
from shards_schema.pixels import pixel_values_from_patches
from tests.helpers.models import hf_rope_index, tiny_qwen2_5_vl, tiny_qwen3_vl
from tests.test_render import expected_mask_from_ids, expected_trained, hf_tokenizers, rand_conversation  # noqa: F401

CONVERSATIONS = 30
TINY_MODELS = {"qwen3-vl": tiny_qwen3_vl, "qwen2.5-vl": tiny_qwen2_5_vl}
MODES = ("RGB", "RGB", "RGBA", "L", "P", "LA", "CMYK")


def encoded_image(nprng: np.random.Generator) -> tuple[bytes, Image.Image]:
    """Random size/mode/format image: its encoded bytes and what HF's processor is given."""
    w, h = (int(v) for v in nprng.integers(9, 700, 2))
    mode = MODES[int(nprng.integers(len(MODES)))]
    img = synthetic_image(nprng, w, h, "RGBA" if mode in ("RGBA", "LA") else "RGB")
    img = img.convert(mode) if mode != "RGBA" else img
    fmt = {"CMYK": "JPEG", "LA": "PNG", "RGBA": "PNG", "P": "PNG"}.get(mode, ["PNG", "JPEG", "WEBP"][int(nprng.integers(3))])
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    data = buf.getvalue()
    return data, ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def without_videos(messages: list) -> list:
    """The conversation with each video part replaced by a text part."""
    return [{**m, "content": [{"type": "text", "text": "a video"} if "video" in p or "video_url" in p else p
                              for p in m["content"]]} if isinstance(m.get("content"), list) else m for m in messages]


def with_real_images(messages: list, rng: random.Random, nprng, media_root) -> list:
    """Replace every image part's source by a real image (data URI, raw base64 or file path)."""
    hf_images = []
    for message in messages:
        if not isinstance(message.get("content"), list):
            continue
        for k, part in enumerate(message["content"]):
            if not (part.get("type") == "image" or "image" in part or "image_url" in part):
                continue
            data, hf_image = encoded_image(nprng)
            kind = rng.choice(["uri", "b64", "path"])
            if kind == "path":
                name = f"img{len(list(media_root.iterdir()))}.bin"
                (media_root / name).write_bytes(data)
                source = name
            else:
                b64 = base64.b64encode(data).decode()
                source = "data:image/x;base64," + b64 if kind == "uri" else b64
            message["content"][k] = rng.choice(
                [{"type": "image_url", "image_url": {"url": source}}, {"type": "image", "image": source}]
            )
            hf_images.append(hf_image)
    return hf_images


@pytest.fixture(scope="module")
def hf_image_processors(builtin_profiles):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = {}
    for family, profile in builtin_profiles.items():
        v = profile.vision
        out[family] = Qwen2VLImageProcessorPil(
            patch_size=v.patch_size, merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
            image_mean=list(v.image_mean), image_std=list(v.image_std), min_pixels=v.min_pixels, max_pixels=v.max_pixels,
        )
    return out


def hf_sample(family, messages, tools, hf_images, tokenizer, template, image_processor, model):
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    if hf_images:
        features = image_processor(images=hf_images, return_tensors="np")
        pixel_values, grid = features["pixel_values"], features["image_grid_thw"]
    else:
        pixel_values, grid = np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64)
    merge = image_processor.merge_size
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(grid) + 1
    expanded = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // merge**2) + p for g, p in zip(grid, pieces[1:]))
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    positions = hf_rope_index(model, ids, grid)
    return ids, positions, pixel_values, grid


@pytest.mark.parametrize("family_name", ["qwen3-vl", "qwen2.5-vl"])
def test_samples_equal_hf_processing(family_name, builtin_profiles, hf_tokenizers, official_template,
                                     hf_image_processors, tmp_path):
    profile = builtin_profiles[family_name]
    tokenizer, template = hf_tokenizers[family_name], official_template[family_name]
    model = TINY_MODELS[family_name]()
    rng, nprng = random.Random(f"oracle-{family_name}"), np.random.default_rng(11)
    options = SampleOptions(media_root=str(tmp_path), max_seq_len=1 << 20)
    seen = {"images": 0, "text_only": 0, "multi_image": 0, "no_targets": 0}
    for n in range(CONVERSATIONS):
        messages, tools, _ = rand_conversation(rng, family_name)
        messages = without_videos(messages)  # rows with videos: tests/test_video.py
        hf_images = with_real_images(messages, rng, nprng, tmp_path)
        row = {"messages": messages, "tools": tools}
        if not any(expected_trained(messages, "all_assistant")):
            with pytest.raises(RejectError, match="no_targets"):
                process_row(row, sample_uid="x", source="x", profile=profile, options=options)
            seen["no_targets"] += 1
            continue
        sample = process_row(row, sample_uid=f"s{n}", source="x", profile=profile, options=options)
        ids, positions, pixel_values, grid = hf_sample(
            family_name, messages, tools, hf_images, tokenizer, template, hf_image_processors[family_name], model
        )
        assert sample.input_ids.tolist() == ids, f"conversation {n}"
        np.testing.assert_array_equal(sample.loss_mask, expected_mask_from_ids(ids, expected_trained(messages, "all_assistant"), tokenizer))
        np.testing.assert_array_equal(sample.position_ids, positions)
        np.testing.assert_array_equal(sample.image_grid_thw, grid)
        if hf_images:
            v = profile.vision
            ours = pixel_values_from_patches(sample.pixel_patches, v.image_mean, v.image_std, v.patch_size, v.temporal_patch_size)
            assert ours.dtype == np.float32 and np.array_equal(ours, pixel_values), f"conversation {n}"
        seen["images"] += len(hf_images)
        seen["text_only"] += not hf_images
        seen["multi_image"] += len(hf_images) > 1
    # the random mix really covered what it claims to
    assert seen["images"] >= 15 and seen["text_only"] >= 2 and seen["multi_image"] >= 3, seen
