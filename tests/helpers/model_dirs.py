"""Hugging Face checkpoint directories without weights, as `vlmpack preprocess --model` reads them."""

from __future__ import annotations

import json
from pathlib import Path

from preprocess.profiles import builtin_profile


def qwen3_vl_model_dir(tmp_path: Path, official_template: dict) -> Path:
    """A Hugging Face Qwen3-VL checkpoint directory without weights: what --model reads."""
    profile = builtin_profile("qwen3-vl")
    v = profile.vision
    d = tmp_path / "Qwen3-VL-tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    (d / "tokenizer.json").write_text(profile.tokenizer_json, encoding="utf-8")
    (d / "chat_template.jinja").write_text(official_template["qwen3-vl"], encoding="utf-8")
    (d / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": v.patch_size, "merge_size": v.merge_size, "temporal_patch_size": v.temporal_patch_size,
        "image_mean": list(v.image_mean), "image_std": list(v.image_std),
        "size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels}}))
    return d
