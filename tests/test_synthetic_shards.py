"""`benchmarks/synthetic_shards.py`, the benchmarks' training mix, for both built-in profiles:
the shards pass the full `verify_shards` (patches vs grids, image pads, vision start/end
pairing, positions, masks, the video rows), no sample is longer than the budget, and the chat layout is the
profile's template's: Qwen2.5-VL's every conversation opens with a system turn (its template's
default text where the draw gave none), Qwen3-VL's only where one was drawn."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from preprocess.profiles import resolve_profile
from shards_schema import open_shards, verify_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_shards import SyntheticSpec, write_synthetic_shards  # noqa: E402


@pytest.mark.parametrize("profile_name", ["qwen3-vl", "qwen2.5-vl"])
def test_synthetic_mix_verifies_and_follows_the_template(tmp_path, profile_name):
    spec = SyntheticSpec(num_samples=40, seed=3, text_tokens=(60, 900), image_tokens=(16, 300), max_tokens=2048,
                         video_prob=0.4, video_seconds=(2.0, 12.0), video_tokens=(16, 600))
    write_synthetic_shards(tmp_path / "data", spec, profile_name=profile_name, log=None)
    report = verify_shards(tmp_path / "data")
    assert report.ok, report.format_text()
    profile = resolve_profile(profile_name)
    shards = open_shards(tmp_path / "data")
    assert shards.manifest["profile"]["id"] == profile.fingerprint["id"]
    opens_with_system, default_system, with_video = 0, 0, 0
    for i in range(len(shards)):
        sample = shards[i]
        ids = np.asarray(sample["input_ids"])
        assert len(ids) <= spec.max_tokens
        text = profile.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        assert text.startswith("<|im_start|>"), text[:40]
        opens_with_system += text.startswith("<|im_start|>system\n")
        # the official Qwen2.5-VL template's default system text
        default_system += text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        videos = sample["video_grid_thw"]
        # Qwen3-VL: the template's pair around a video and one more per temporal group
        groups = int(videos[:, 0].sum()) if profile_name == "qwen3-vl" else 0
        assert text.count("<|vision_start|>") == text.count("<|vision_end|>") == len(sample["image_grid_thw"]) + len(videos) + groups
        assert text.count("<|video_pad|>") == int(videos.prod(axis=1).sum()) // 4
        with_video += len(videos)
        if profile_name == "qwen3-vl" and len(videos):
            assert text.count(" seconds>") == groups
    assert 8 <= with_video <= 24  # about 40 % of 40 samples
    if profile_name == "qwen2.5-vl":
        assert opens_with_system == len(shards) and 0 < default_system < len(shards)
    else:
        assert 0 < opens_with_system < len(shards) and default_system == 0
