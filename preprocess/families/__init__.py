"""Model families on the preprocessing side: one module per family (`qwen3_vl.py`,
`qwen2_5_vl.py`) holds everything about it that preprocessing must reproduce and that is not
the shard contract's (that part is its `shard_rules`, from `shards_schema.families`):

* its chat templates: what each would silently drop (rejected first) and the renderer that
  writes a conversation exactly as the official template does, with the sha256 of each
  official template (`preprocess.render` holds the parsing and the text builder they share);
* its HF video processor's rules in the `hf` sampling mode: frame indices, the `total_pixels`
  bound and the resize, and the video settings of its built-in profile;
* what the generated examples (`preprocess.examples`) give it.

Modules: `qwen3_vl.py`, `qwen2_5_vl.py`, `qwen3_5.py` (Qwen3.5 and Qwen3.6, with
`qwen3_5_constants.py`, the published processor settings).

Shared code asks a family (a profile's `family_rules`, or `family_named(name)`) instead of
testing its name. The registry below maps family names, Hugging Face `model_type`s and the
built-in profile names to families.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from shards_schema.builtin import BUILTIN_PROFILE_FAMILY, VideoDefaults
from shards_schema.families import FamilyRules

from ..render import Message, TextBuilder
from ..video.sampling import VideoRequest
from . import qwen2_5_vl, qwen3_5, qwen3_vl

__all__ = ["BUILTIN_PROFILES", "FAMILIES", "FAMILY_NAMES", "MODEL_TYPE_FAMILY", "ModelFamily", "family_named",
           "official_template_kind"]


class ModelFamily(Protocol):
    """The interface of a family object (one per module, e.g. `qwen3_vl.FAMILY`)."""

    name: str  # the family's name, as profiles and manifests record it: "qwen3-vl"
    shard_rules: FamilyRules  # its rules of the shard contract: video positions and layout, tokenizer variant
    templates: tuple[str, ...]  # the chat template kinds it renders natively ("instruct", "thinking")
    reasoning_templates: tuple[str, ...]  # those of `templates` that render an assistant's reasoning_content
    # those of `templates` whose `preserve_thinking` keeps the reasoning of turns before the last user query
    preserve_thinking_templates: tuple[str, ...]
    official_template_sha256: Mapping[str, str]  # template kind -> sha256 of the official chat_template.jinja
    builtin_video: VideoDefaults  # the video processor settings of its built-in profile
    example_tool_call_share: float  # share of example conversations given a tool call (0: its templates drop them)

    def reject_dropped_content(self, messages: list[Message], tools: list[dict], template: str) -> None:
        """Raise a RejectError (`dropped_by_template`, ...) for content the template would
        silently leave out of the text."""
        ...

    def render(self, out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool], template: str,
               reasoning_loss: str, preserve_thinking: bool) -> None:
        """Write the conversation into `out` as the official `template` renders it, marking the
        messages flagged in `targets` as training targets (`reasoning_loss`: the Thinking
        template's reasoning is trained, "train", or context, "mask"; `preserve_thinking`: the
        template variable, for a template in `preserve_thinking_templates`). `out` writes the
        images and videos (`TextBuilder.add_items`), with `add_vision_id`'s numbers if set."""
        ...

    def hf_frame_indices(self, total_frames: int, video_fps: float, fps: float | None, nframes: int | None,
                         min_frames: int, max_frames: int, temporal_patch_size: int) -> np.ndarray:
        """The frame indices its HF video processor samples (`sample_frames`) from a window of
        `total_frames` frames at `video_fps`."""
        ...

    def hf_max_pixels_within_total(self, request: VideoRequest, *, min_pixels: int, max_pixels: int, num_frames: int,
                                   temporal_patch_size: int) -> int:
        """The `max_pixels` its processor resizes with when the part sets `total_pixels`."""
        ...

    def hf_resize(self, num_frames: int, height: int, width: int, *, patch_size: int, merge_size: int,
                  temporal_patch_size: int, min_pixels: int, max_pixels: int, max_video_tokens: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        """The (height, width) its HF video processor resizes the sampled frames to."""
        ...


# Adding a family: its module here, its entry in FAMILIES, its HF model_types and built-in
# profiles below (docs/families.md).
FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (qwen3_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_5.FAMILY)}
FAMILY_NAMES = tuple(FAMILIES)

# HF `config.json` model_type -> family name.
MODEL_TYPE_FAMILY = {
    "qwen3_vl": "qwen3-vl",
    "qwen3_vl_moe": "qwen3-vl",  # Qwen3-VL-30B-A3B / 235B-A22B: the dense models' processor and templates
    "qwen2_5_vl": "qwen2.5-vl",
    "qwen2_vl": "qwen2.5-vl",  # same template and processor rules as Qwen2.5-VL
    "qwen3_5": "qwen3.5",  # Qwen3.5 and Qwen3.6 (dense)
    "qwen3_5_moe": "qwen3.5",  # Qwen3.5 and Qwen3.6 (mixture of experts)
}

# built-in profile -> (family name, chat template): the Thinking checkpoints share the Instruct
# ones' tokenizer, vision and video settings, and differ in their template; Qwen3.6 is Qwen3.5's
# model family with its own chat template (the families: shards_schema.builtin, which export reads too).
_PROFILE_TEMPLATES = {"qwen3-vl": "instruct", "qwen2.5-vl": "instruct", "qwen3-vl-thinking": "thinking",
                      "qwen3.5": "qwen3.5", "qwen3.6": "qwen3.6"}
BUILTIN_PROFILES = {name: (BUILTIN_PROFILE_FAMILY[name], template) for name, template in _PROFILE_TEMPLATES.items()}


def family_named(name: str) -> ModelFamily:
    """The family called `name`; ValueError for a name that is not a family."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown family {name!r}; choose one of {FAMILY_NAMES}")
    return family


def official_template_kind(sha256: str) -> str | None:
    """The kind ("instruct", "thinking", "qwen3.5", ...) of the official chat template, of any family, whose
    text has this sha256; None for any other template."""
    for family in FAMILIES.values():
        for kind, official in family.official_template_sha256.items():
            if official == sha256:
                return kind
    return None
