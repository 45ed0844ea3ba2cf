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
import random

import numpy as np
import pytest

from preprocess.errors import RejectError
from preprocess.pipeline import SampleOptions, process_row
from shards_schema.pixels import pixel_values_from_patches
from tests.helpers.hf_reference import hf_sample
from tests.helpers.images import encoded_image
from tests.helpers.models import TINY_MODELS
from tests.helpers.render import expected_mask_from_ids, expected_trained, rand_conversation

CONVERSATIONS = 30


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
