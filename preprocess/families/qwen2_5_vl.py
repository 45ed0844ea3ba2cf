"""Qwen2.5-VL (and Qwen2-VL, whose template and processors are the same): its Instruct chat
template, rendered natively, and its processors' video rules.

Template (`render`): every message renders as a turn under its own role, with the default
system prompt when the conversation has none; tools and tool calls are not rendered, so a row
holding them is rejected (`reject_dropped_content`).

Videos (`Qwen2VLVideoProcessor`): `sample_frames` takes a float32 `arange` of a multiple of
`temporal_patch_size` frames, and the image processor's `smart_resize` sizes each frame. The
layout of a video's tokens (pads only) and its M-RoPE rule are the shard contract's:
`shards_schema.families.qwen2_5_vl`.
"""

from __future__ import annotations

import math

import numpy as np

from shards_schema.builtin import QWEN2_5_VL_VIDEO
from shards_schema.families import qwen2_5_vl as shard_qwen2_5_vl

from ..images import smart_resize as image_smart_resize
from ..render import IM_END, IM_START, Message, TextBuilder, reject, render_assistant
from ..video.sampling import VideoRequest, sampling_error

QWEN2_5_DEFAULT_SYSTEM = "You are a helpful assistant."



def _render_instruct(out: TextBuilder, messages: list[Message], targets: list[bool]) -> None:
    if messages[0].role != "system":
        out.add(IM_START + "system\n" + QWEN2_5_DEFAULT_SYSTEM + IM_END + "\n")
    for i, message in enumerate(messages):
        if message.role == "assistant":
            render_assistant(out, message, targets[i])
        else:  # system, user and tool all render the same way, under their own role name
            out.add(IM_START + message.role + "\n")
            out.add_items(message.items)
            out.add(IM_END + "\n")


def hf_qwen2_indices(total_frames: int, video_fps: float, fps: float | None, nframes: int | None,
                     min_frames: int, max_frames: int, temporal_patch_size: int) -> np.ndarray:
    """`Qwen2VLVideoProcessor.sample_frames` (torch float32 arange, as it computes)."""
    import torch

    if fps is not None and nframes is not None:
        raise sampling_error("`fps` and `nframes` are mutually exclusive: give one")
    num_frames = None
    if nframes is not None:
        num_frames = round(nframes / temporal_patch_size) * temporal_patch_size
    elif fps is not None:
        max_frames = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
        num_frames = total_frames / video_fps * fps
        num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
        num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    if num_frames is not None and num_frames > total_frames:
        raise sampling_error(f"{num_frames} frames asked of a video of {total_frames}: lower `nframes` or `fps`")
    if num_frames is not None and num_frames <= 0:
        raise sampling_error(
            f"a video of {total_frames} frames at {video_fps:g} fps samples no frame "
            f"(at least {temporal_patch_size} are needed)")
    if num_frames is not None:
        indices = torch.arange(0, total_frames, total_frames / num_frames).int()
    else:
        indices = torch.arange(0, total_frames).int()
    return indices.numpy().astype(np.int64)


class Qwen2_5VL:
    """Qwen2.5-VL's preprocessing rules (interface: `preprocess.families.ModelFamily`)."""

    name = "qwen2.5-vl"
    shard_rules = shard_qwen2_5_vl.RULES
    templates = ("instruct",)
    reasoning_templates = ()  # its template renders no reasoning
    preserve_thinking_templates = ()
    # sha256 of the official chat_template.jinja the renderer reproduces
    official_template_sha256 = {"instruct": "a0bc6f6fc7a29a80017a433e8f03a1cc1236e838a944a2d034295a60c4f2fddb"}
    builtin_video = QWEN2_5_VL_VIDEO
    example_tool_call_share = 0.0  # its template renders no tool calls

    def reject_dropped_content(self, messages: list[Message], tools: list[dict], template: str) -> None:
        if tools:
            raise reject(
                "dropped_by_template",
                None,
                "qwen2.5-vl's template does not render tools; the tool schemas would be dropped",
            )
        for m in messages:
            if m.tool_calls:
                raise reject(
                    "dropped_by_template",
                    m.index,
                    "qwen2.5-vl's template does not render tool_calls; they would be dropped",
                )

    def render(self, out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool], template: str,
               reasoning_loss: str, preserve_thinking: bool) -> None:
        _render_instruct(out, messages, targets)

    def hf_frame_indices(self, total_frames: int, video_fps: float, fps: float | None, nframes: int | None,
                         min_frames: int, max_frames: int, temporal_patch_size: int) -> np.ndarray:
        return hf_qwen2_indices(total_frames, video_fps, fps, nframes, min_frames, max_frames, temporal_patch_size)

    def hf_max_pixels_within_total(self, request: VideoRequest, *, min_pixels: int, max_pixels: int, num_frames: int,
                                   temporal_patch_size: int) -> int:
        """The processor's total bound, with the given budget: a per-frame share of `total_pixels`."""
        return max(min(max_pixels, request.total_pixels * temporal_patch_size // num_frames), int(min_pixels * 1.05))

    def hf_resize(self, num_frames: int, height: int, width: int, *, patch_size: int, merge_size: int,
                  temporal_patch_size: int, min_pixels: int, max_pixels: int, max_video_tokens: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        factor = patch_size * merge_size
        if cap_pixels_per_frame:
            total_pixels = int(max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal_patch_size // num_frames), int(min_pixels * 1.05))
        return image_smart_resize(height, width, factor, min_pixels, max_pixels)


FAMILY = Qwen2_5VL()
