"""Qwen3-VL (Qwen3-VL-*-Instruct and -Thinking checkpoints): its chat templates, rendered
natively, and its processors' video rules.

Templates (`render`): the Instruct template writes a system message only as the first message,
tools into that system turn and tool results as `<tool_response>` blocks of a user turn; the
Thinking template also renders `<think>` reasoning in the assistant turns after the last user
query. What either would drop is rejected first (`reject_dropped_content`).

Videos (`Qwen3VLVideoProcessor`): `sample_frames` takes `linspace` indices, and its own
`smart_resize` bounds the whole clip's pixels (`size["longest_edge"]` is the clip's budget).
The layout of a video's tokens (timestamps, inner markers) and its M-RoPE rule are the shard
contract's: `shards_schema.families.qwen3_vl`.
"""

from __future__ import annotations

import math

import numpy as np

from shards_schema.builtin import QWEN3_VL_VIDEO
from shards_schema.families import qwen3_vl as shard_qwen3_vl

from ..errors import RejectError
from ..images import MAX_ASPECT_RATIO
from ..render import (IM_END, IM_START, IMAGE, IMAGE_PLACEHOLDER, TEXT, VIDEO, VIDEO_PLACEHOLDER, Message, TextBuilder,
                      json_text, reject, render_assistant, render_tool_calls)
from ..video.sampling import VideoRequest, check_option_bounds, sampling_error

QWEN3_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' + IM_END + "\n"
)

# Qwen3-VL-*-Instruct video_preprocessor_config.json (size, mean/std) over the class defaults
# (fps 2, min_frames 4, max_frames 768, max_video_tokens 768).


# ---------------------------------------------------------------------------------------------
# Rendering


def _first_visual(message: Message) -> str | None:
    """IMAGE or VIDEO: the kind of the message's first image or video part, or None."""
    return next((kind for kind, _, _ in message.items if kind in (IMAGE, VIDEO)), None)


def _render_system(out: TextBuilder, system: Message | None, tools: list[dict]) -> None:
    if tools:
        out.add(IM_START + "system\n")
        if system is not None:
            out.add_items(system.items, text_only=True)
            out.add("\n\n")
        out.add(QWEN3_TOOLS_INTRO)
        for k, tool in enumerate(tools):
            out.add("\n")
            out.add(json_text(tool, "bad_tools", None, f"tools[{k}]"), where=f"tools[{k}]")
        out.add(QWEN3_TOOLS_OUTRO)
    elif system is not None:
        out.add(IM_START + "system\n")
        out.add_items(system.items, text_only=True)
        out.add(IM_END + "\n")


def _render_instruct(out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool]) -> None:
    system = messages[0] if messages[0].role == "system" else None
    _render_system(out, system, tools)
    for i, message in enumerate(messages):
        if message.role == "user":
            out.add(IM_START + "user\n")
            out.add_items(message.items)
            out.add(IM_END + "\n")
        elif message.role == "assistant":
            render_assistant(out, message, targets[i])
        elif message.role == "tool":
            _render_tool_result(out, messages, i)
        # system: rendered above (only as the first message; validation rejects any other)


def _render_tool_result(out: TextBuilder, messages: list[Message], i: int) -> None:
    """Consecutive tool results share one user turn, each wrapped in <tool_response> (Qwen3-VL)."""
    if i == 0 or messages[i - 1].role != "tool":
        out.add(IM_START + "user")
    out.add("\n<tool_response>\n")
    out.add_items(messages[i].items)
    out.add("\n</tool_response>")
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
        out.add(IM_END + "\n")


def _text_of(message: Message) -> tuple[str, str]:
    """A text-only message's content as one string, and where it came from."""
    text = "".join(value for kind, value, _ in message.items if kind == TEXT)
    return text, (message.items[0][2] if message.items else f"messages[{message.index}].content")


def _last_query_index(messages: list[Message]) -> int:
    """The Thinking template's last real user message: scanning back, the first user turn that is
    not wholly a `<tool_response>` (default: the last message)."""
    for message in reversed(messages):
        if message.role == "user":
            text = "".join(value if kind == TEXT else (IMAGE_PLACEHOLDER if kind == IMAGE else VIDEO_PLACEHOLDER)
                           for kind, value, _ in message.items)
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return message.index
    return len(messages) - 1


def _split_reasoning(message: Message) -> tuple[str, str, str]:
    """(reasoning, content, where): `reasoning_content`, or the `<think>` block the template cuts
    out of the content; content that the cut would drop is rejected."""
    content, where = _text_of(message)
    if message.reasoning is not None:
        return message.reasoning, content, f"messages[{message.index}].reasoning_content"
    if "</think>" not in content:
        return "", content, where
    head, _, tail = content.partition("</think>")
    before, _, reasoning = head.rstrip("\n").rpartition("<think>")
    if before.strip() or "</think>" in tail:
        raise reject("dropped_by_template", message.index, "the Thinking template keeps one <think>...</think> block "
                     "at the start of an assistant turn; text before it or a second block would be dropped")
    return reasoning.lstrip("\n"), tail.lstrip("\n"), where


def _render_assistant_thinking(out: TextBuilder, message: Message, target: bool, after_query: bool, last: bool,
                               reasoning_loss: str) -> None:
    reasoning, content, where = _split_reasoning(message)
    out.add(IM_START + "assistant\n")
    if after_query and (last or reasoning):
        # The generation prompt ends with "<think>\n": what follows is what the model writes.
        out.add("<think>\n")
        think = target and reasoning_loss == "train"
        out.add(reasoning.strip("\n"), think, where)
        out.add("\n</think>\n\n", think)
        content = content.lstrip("\n")
    elif reasoning.strip():
        raise reject("dropped_by_template", message.index, "the Thinking template drops the reasoning of an "
                     "assistant turn before the last user message; give each turn its own row")
    out.add(content, target, where)
    render_tool_calls(out, message, target, content_truthy=bool(content))
    out.add(IM_END, target)
    out.add("\n")


def _render_thinking(out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool],
                     reasoning_loss: str) -> None:
    system = messages[0] if messages[0].role == "system" else None
    _render_system(out, system, tools)
    last_query = _last_query_index(messages)
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if message.role == "user" or (message.role == "system" and i > 0):
            out.add(IM_START + message.role + "\n")
            out.add_items(message.items)
            out.add(IM_END + "\n")
        elif message.role == "assistant":
            _render_assistant_thinking(out, message, targets[i], i > last_query, i == last, reasoning_loss)
        elif message.role == "tool":
            _render_tool_result(out, messages, i)


# ---------------------------------------------------------------------------------------------
# Video processor (hf sampling mode)


def hf_qwen3_indices(total_frames: int, video_fps: float, fps: float | None, nframes: int | None,
                     min_frames: int, max_frames: int) -> np.ndarray:
    """`Qwen3VLVideoProcessor.sample_frames`."""
    if fps is not None and nframes is not None:
        raise sampling_error("`fps` and `nframes` are mutually exclusive: give one")
    num_frames = nframes
    if num_frames is None and fps is not None:
        # capped at total_frames before int(): the same count as HF's, without int() of an overflowed
        # product (a huge fps) raising
        num_frames = int(min(total_frames / video_fps * fps, total_frames))
        num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
    if num_frames is None:
        num_frames = min(max(total_frames, min_frames), max_frames)
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int)


def qwen3_video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                             min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """`transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize`."""
    if num_frames < temporal_factor:
        raise sampling_error(f"{num_frames} frames sampled, at least {temporal_factor} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RejectError("aspect_ratio", f"video {width}x{height}: aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3VL:
    """Qwen3-VL's preprocessing rules (interface: `preprocess.families.ModelFamily`)."""

    name = "qwen3-vl"
    shard_rules = shard_qwen3_vl.RULES
    templates = ("instruct", "thinking")
    reasoning_templates = ("thinking",)  # the Thinking template renders <think> reasoning
    preserve_thinking_templates = ()  # the Thinking template drops earlier turns' reasoning, always
    # sha256 of the official chat_template.jinja of each template the renderer reproduces
    official_template_sha256 = {
        "instruct": "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4",
        "thinking": "36e042fe45641f067b1f2381fcc8955d10d956a3ed333ecdf7f7eb0916f68956",
    }
    builtin_video = QWEN3_VL_VIDEO
    example_tool_call_share = 0.1  # its templates render tool calls: the examples show some

    def reject_dropped_content(self, messages: list[Message], tools: list[dict], template: str) -> None:
        if template == "thinking":
            for m in messages:
                visual = _first_visual(m)
                if m.role in ("system", "assistant") and visual:
                    raise reject("bad_content", m.index, f"{visual}s inside {m.role} messages are not supported with "
                                 "the Thinking template; put them in a user turn")
            return
        for m in messages:
            visual = _first_visual(m)
            if m.role == "system" and m.index != 0:
                raise reject(
                    "dropped_by_template",
                    m.index,
                    "qwen3-vl renders a system message only as the first message; this one would be dropped",
                )
            if m.role in ("system", "assistant") and visual:
                raise reject("dropped_by_template", m.index, f"qwen3-vl drops {visual}s inside {m.role} messages")

    def render(self, out: TextBuilder, messages: list[Message], tools: list[dict], targets: list[bool], template: str,
               reasoning_loss: str, preserve_thinking: bool) -> None:
        if template == "thinking":
            _render_thinking(out, messages, tools, targets, reasoning_loss)
        else:
            _render_instruct(out, messages, tools, targets)

    def hf_frame_indices(self, total_frames: int, video_fps: float, fps: float | None, nframes: int | None,
                         min_frames: int, max_frames: int, temporal_patch_size: int) -> np.ndarray:
        return hf_qwen3_indices(total_frames, video_fps, fps, nframes, min_frames, max_frames)

    def hf_max_pixels_within_total(self, request: VideoRequest, *, min_pixels: int, max_pixels: int, num_frames: int,
                                   temporal_patch_size: int) -> int:
        """size["longest_edge"] is already the whole clip's budget: `total_pixels` caps it."""
        max_pixels = min(max_pixels, request.total_pixels)
        check_option_bounds("min_pixels", request.min_pixels, "total_pixels", request.total_pixels)
        return max_pixels

    def hf_resize(self, num_frames: int, height: int, width: int, *, patch_size: int, merge_size: int,
                  temporal_patch_size: int, min_pixels: int, max_pixels: int, max_video_tokens: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        factor = patch_size * merge_size
        if cap_pixels_per_frame:
            frame_cap = max_video_tokens * factor * factor
            pixels_per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
            max_pixels = pixels_per_frame * num_frames
        return qwen3_video_smart_resize(num_frames, height, width, temporal_patch_size, factor, min_pixels, max_pixels)


FAMILY = Qwen3VL()
