"""Native chat rendering for the Qwen-VL families, with loss spans.

`render_conversation` turns one OpenAI-format conversation into the exact text the official
chat template of the family produces (`qwen3-vl`: Qwen3-VL-*-Instruct, or with
`template="thinking"` Qwen3-VL-*-Thinking, whose assistant turns carry `<think>` reasoning;
`qwen2.5-vl`: Qwen2.5-VL / Qwen2-VL Instruct; `qwen3.5`: Qwen3.5 / Qwen3.6, thinking and XML
tool calls), built with plain string operations: no jinja at
run time. This module holds what the templates share: the parsing and checking of the row
(`Message`), the text builder that records targets (`TextBuilder`) and the ChatML turns they
all write; each family's own template rules and renderers are in its module of
`preprocess.families`, which `render_conversation` is given.
Because the renderer writes the text piece by piece, it knows which characters are training
targets (assistant content, rendered tool calls and the closing `<|im_end|>`), something the
templates cannot say since they have no `{% generation %}` markers.

`tokenize_rendered` encodes that text once, exactly as Hugging Face does after applying the
template, and turns the character spans into a per-token loss mask.

The templates silently drop some content (a Qwen3-VL system message that is not first,
images in Qwen3-VL system/assistant turns, tool calls and tool schemas under Qwen2.5-VL, ...).
Training data must not lose content behind the user's back, so such rows are rejected
(`dropped_by_template`) instead.

`check_template_matches` guards the `--model DIR` path: the directory's template must render
a set of probe conversations exactly like this module, or the job stops before any work.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from bisect import bisect_right
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain

import numpy as np

from .errors import ConfigError, RejectError
from .images import ImageRequest, image_request_from_part
from .video import VideoRequest, request_from_part

LOSS_POLICIES = ("all_assistant", "last_assistant")
REASONING_LOSSES = ("train", "mask")  # Thinking: is an assistant turn's reasoning a target
ROLES = ("system", "user", "assistant", "tool")
# RejectError codes raised by render_conversation (rejects.jsonl groups rows by them).
REJECT_CODES = (
    "no_messages",  # messages missing, empty or not a list
    "bad_message",  # a message that is not an object, has no role, or a bad `train` flag or `weight`
    "unknown_role",  # role outside system/user/assistant/tool
    "bad_content",  # content/part shapes the templates cannot render as intended
    "bad_video_option",  # a video part's sampling option of the wrong kind or range
    "bad_image_option",  # an image part's min_pixels / max_pixels of the wrong kind or range
    "unsupported_field",  # a part's option vlmpack does not apply (resized_height / resized_width)
    "bad_tool_call",  # malformed assistant tool_calls
    "bad_tools",  # row `tools` not a list of objects
    "dropped_by_template",  # the template would silently leave content out of the text
    "vision_token_in_text",  # a literal vision token in text would desynchronise images and pads
    "special_token_in_text",  # a literal chat-control token in text would be read as structure
    "bad_text",  # text that is not valid Unicode (a lone surrogate)
    "no_targets",  # no assistant turn is trained under the loss policy
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
# Text that must come only from images: downstream stages count these tokens to place pixels
# and M-RoPE positions, so a literal copy inside message text would desynchronise them.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# The tokenizer reads a special token's text as that token wherever it appears, also inside
# message text (HF's template + tokenizer do the same). For these the result is a different
# conversation structure (a turn that ends early, an end of text, a fake image), so text holding
# them is rejected. `Profile.text_special_tokens` extends this with the tokenizer's own list.
CHAT_CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Special tokens that Qwen-VL grounding data writes inside text on purpose (`<|box_start|>(x1,y1),
# (x2,y2)<|box_end|>`): they mark spans within a turn and are kept, as HF keeps them.
GROUNDING_TOKENS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
)
DEFAULT_TEXT_SPECIAL_TOKENS = CHAT_CONTROL_TOKENS + VISION_TOKENS

# Message fields HF treats as reasoning; the Instruct templates render none of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# OpenAI message fields no Qwen template renders, and what to write instead
UNRENDERED_FIELDS = {"function_call": "convert it to tool_calls: [{\"type\": \"function\", \"function\": {\"name\", "
                                      "\"arguments\"}}]",
                     "refusal": "write the refusal as the message's content"}


@dataclass
class Rendered:
    """One conversation rendered to text, before tokenization."""

    text: str  # the full rendered conversation; each image as IMAGE_PLACEHOLDER, each video as VIDEO_PLACEHOLDER
    target_spans: list[tuple[int, int]]  # sorted, disjoint [start, end) character spans that are targets
    image_sources: list  # the image reference of each image, in order of appearance (str or embedded bytes)
    videos: list[VideoPart] = field(default_factory=list)  # each video, in order of appearance
    image_requests: list[ImageRequest] = field(default_factory=list)  # each image's own size bounds, in order
    # [start, end) spans no token may be a target through, even in part (`add_vision_id`'s labels)
    context_spans: list[tuple[int, int]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Validation: untrusted JSON -> a small normalised form the renderers can trust.
# ---------------------------------------------------------------------------------------------

TEXT, IMAGE, VIDEO = "text", "image", "video"


@dataclass(frozen=True)
class VideoPart:
    """A video part: its source (a reference string, or a list of frame image references) and
    its own sampling options."""

    source: str | list[str]
    request: VideoRequest


@dataclass
class Message:
    """One message of a row, parsed and checked: what a family's renderer writes."""

    index: int  # position in the input list, for error messages
    role: str
    # (TEXT, text, where), (IMAGE, (source, ImageRequest), where) or (VIDEO, VideoPart, where)
    items: list[tuple[str, object, str]]
    content_truthy: bool  # jinja truthiness of the raw `content` (decides a tool-call separator)
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, rendered arguments)
    train: bool | None = None  # per-message loss override (assistant only)
    reasoning: str | None = None  # `reasoning_content` (templates that render reasoning only)
    tool_call_arguments: list = field(default_factory=list)  # each tool call's arguments as given (object or string)


def reject(code: str, index: int | None, message: str) -> RejectError:
    """A reject naming the message it concerns (`index`; None: the row as a whole)."""
    where = "" if index is None else f"message {index}: "
    return RejectError(code, where + message)


def _part_kind(part: dict) -> str | None:
    """Classify a content part with the templates' own test order (image, video, text)."""
    part_type = part.get("type")
    if part_type == "image" or "image" in part or "image_url" in part:
        return IMAGE
    if part_type in ("video", "video_url") or "video" in part or "video_url" in part:
        return VIDEO
    if "text" in part:
        return TEXT
    return None


def _part_source(part: dict, kind: str):
    """The reference of an image or video part: OpenAI `<kind>_url` (object or string), HF
    `<kind>`, or `url`/`path`."""
    if f"{kind}_url" in part:
        source = part[f"{kind}_url"]
        return source.get("url") if isinstance(source, dict) else source
    if kind in part:
        return part[kind]
    return part.get("url", part.get("path"))


def _image_source(part: dict, where: str, index: int):
    """The image reference of an image part: OpenAI `image_url` (object or string) or HF
    `image/url/path`; a string, or embedded bytes (raw, or an HF `Image` feature's
    `{"bytes", "path"}`, as `preprocess.media` reads them)."""
    source = _part_source(part, IMAGE)
    if not (isinstance(source, str) and source) and not _is_embedded(source):
        raise reject(
            "bad_content", index, f"{where}: image part without a string source (image_url.url, image, url or path)"
        )
    return source


def _is_embedded(source) -> bool:
    return isinstance(source, (bytes, bytearray)) or (
        isinstance(source, dict) and (source.get("bytes") is not None or isinstance(source.get("path"), str)))


def _video_part(part: dict, where: str, index: int) -> VideoPart:
    """A video part: OpenAI-style `video_url` (object or string), or `video` (a reference or a
    list of frame references, as qwen-vl-utils takes), or `url`/`path`; options at part level."""
    if part.get("type") not in (None, "video", "video_url"):
        raise reject("bad_content", index, f"{where}: part of type {part['type']!r} carries a video key")
    if "text" in part:
        raise reject("dropped_by_template", index, f"{where}: the template renders this part as a video and would drop its text")
    source = _part_source(part, VIDEO)
    frames = isinstance(source, list)
    if frames and (not source or not all((isinstance(f, str) and f) or _is_embedded(f) for f in source)):
        raise reject("bad_content", index, f"{where}: a video given as frames must be a non-empty list of image references")
    if not frames and not (isinstance(source, str) and source) and not _is_embedded(source):
        raise reject("bad_content", index, f"{where}: video part without a source (video_url.url, video, url or path)")
    try:
        request = request_from_part(part, where)
    except RejectError as exc:
        raise reject(exc.code, index, exc.message) from None
    return VideoPart(source=list(source) if frames else source, request=request)


def _parse_part(part, where: str, index: int) -> tuple[str, object, str]:
    if not isinstance(part, dict):
        raise reject("bad_content", index, f"{where}: a content part must be an object, got {type(part).__name__}")
    # Arrow-backed inputs (Parquet, `datasets`) give every part every struct key, absent ones as
    # null. A null key is absent: the jinja templates would test `'image_url' in part` as true.
    part = {k: v for k, v in part.items() if v is not None}
    kind = _part_kind(part)
    part_type = part.get("type")
    if kind == VIDEO:
        return VIDEO, _video_part(part, where, index), f"messages[{index}].{where}"
    if kind == IMAGE:
        if part_type not in (None, "image", "image_url"):
            raise reject("bad_content", index, f"{where}: part of type {part_type!r} carries an image key")
        if "text" in part:
            raise reject(
                "dropped_by_template",
                index,
                f"{where}: the template renders this part as an image and would drop its text",
            )
        source = _image_source(part, where, index)
        try:
            request = image_request_from_part(part, where)
        except RejectError as exc:
            raise reject(exc.code, index, exc.message) from None
        return IMAGE, (source, request), f"messages[{index}].{where}"
    if kind == TEXT:
        if part_type not in (None, "text"):
            raise reject("bad_content", index, f"{where}: unknown part type {part_type!r}")
        if not isinstance(part["text"], str):
            raise reject("bad_content", index, f"{where}: text must be a string, got {type(part['text']).__name__}")
        return TEXT, part["text"], f"messages[{index}].{where}.text"
    if part_type == "text":
        raise reject("bad_content", index, f"{where}: text must be a string, got no text (missing or null)")
    if part_type == "image_url":  # without an image_url key the template would not even see an image
        raise reject("bad_content", index, f"{where}: image part without a string source (image_url.url)")
    raise reject("bad_content", index,
                 f"{where}: unknown part type {part_type!r} (expected text, image_url, image, video_url or video)")


def _parse_content(message: dict, role: str, index: int) -> tuple[list[tuple[str, str, str]], bool]:
    content = message.get("content")
    if content is None and role == "assistant":
        return [], False  # allowed for tool-call turns; renders like the template's missing content
    if isinstance(content, str):
        return [(TEXT, content, f"messages[{index}].content")], bool(content)
    if isinstance(content, list):
        items = [_parse_part(part, f"content[{k}]", index) for k, part in enumerate(content)]
        return items, bool(content)
    raise reject(
        "bad_content", index, f"{role} content must be a string or a list of parts, got {type(content).__name__}"
    )


def json_text(value, code: str, index: int | None, where: str) -> str:
    """`value` as the templates' `tojson` writes it. What JSON cannot hold (NaN and infinite
    numbers, which `tojson` would write as the non-JSON `NaN` / `Infinity`; bytes, decimals) or
    what is nested too deep to write is rejected with `code`: a target the model learns must be
    valid JSON."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise reject(code, index, f"{where} is nested too deep to write as JSON") from None
    except (TypeError, ValueError) as exc:
        raise reject(code, index, f"{where} holds a value JSON cannot hold ({exc}); write NaN and infinite "
                     "numbers as strings, or leave them out") from None


def _render_arguments(arguments, index: int, k: int) -> str:
    """A string is rendered verbatim (OpenAI's JSON string), an object as the template's `tojson`.
    A string that is not JSON, or parses only as Python's `json` reads it, holding NaN or an
    infinity (`NaN`, `Infinity`, `1e999`), is rejected as an object holding them is: the target
    would teach calls that no parser of the model's output reads."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except RecursionError:
            raise reject("bad_tool_call", index, f"tool_calls[{k}].arguments is nested too deep for the JSON parser "
                         "(about 1000 levels): flatten it") from None
        except ValueError:
            raise reject("bad_tool_call", index, f"tool_calls[{k}].arguments is a string that is not JSON "
                         f"({ascii(arguments):.60}): OpenAI's arguments are the JSON text of the call's "
                         "arguments; write it as JSON, or as an object") from None
        json_text(parsed, "bad_tool_call", index, f"tool_calls[{k}].arguments")
        return arguments
    if isinstance(arguments, dict):
        return json_text(arguments, "bad_tool_call", index, f"tool_calls[{k}].arguments")
    raise reject("bad_tool_call", index, f"tool_calls[{k}].arguments must be a JSON string or an object")


def _parse_tool_calls(message: dict, role: str, index: int) -> list[tuple[str, str]]:
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        return []
    if role != "assistant":
        raise reject("dropped_by_template", index, f"tool_calls on a {role} message would be dropped by the template")
    if not isinstance(tool_calls, list):
        raise reject("bad_tool_call", index, "tool_calls must be a list")
    parsed = []
    for k, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise reject("bad_tool_call", index, f"tool_calls[{k}] must be an object")
        function = call.get("function") or call  # the template accepts OpenAI and bare {name, arguments}
        if not isinstance(function, dict):
            raise reject("bad_tool_call", index, f"tool_calls[{k}].function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise reject("bad_tool_call", index, f"tool_calls[{k}] needs a function name (string)")
        if "arguments" not in function:
            raise reject("bad_tool_call", index, f"tool_calls[{k}] has no arguments")
        parsed.append((name, _render_arguments(function["arguments"], index, k)))
    return parsed


def _parse_message(message, index: int, renders_reasoning: bool = False) -> Message:
    if not isinstance(message, dict):
        raise reject("bad_message", index, f"a message must be an object, got {type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}  # as HF's apply_chat_template does
    if "role" not in message:
        raise reject("bad_message", index, "missing role")
    role = message["role"]
    if role not in ROLES:
        raise reject("unknown_role", index, f"role {role!r} is not one of {', '.join(ROLES)}")
    train = message.get("train")
    if train is not None and not isinstance(train, bool):
        raise reject("bad_message", index, "train must be true or false")
    flag = "train: true"
    if "weight" in message:  # OpenAI's fine-tuning format: 0 leaves an assistant turn out of the loss
        weight = message["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
            raise reject("bad_message", index, f"weight must be 0 or 1, got {type(weight).__name__} "
                         f"{ascii(weight):.80}")
        if train is not None and train != (weight == 1):
            raise reject("bad_message", index, f"train: {str(train).lower()} and weight: {weight} disagree; give one")
        train, flag = weight == 1, "weight: 1"
    if train and role != "assistant":
        raise reject("bad_message", index, f"{flag} on a {role} message (only assistant turns are trained)")
    reasoning = None
    if renders_reasoning and role == "assistant" and "reasoning_content" in message:
        reasoning = message["reasoning_content"]  # a string, even empty, is what the template renders
        if not isinstance(reasoning, str):
            raise reject("bad_content", index, "reasoning_content must be a string")
    for name in REASONING_FIELDS:
        if not message.get(name) or reasoning is not None and name == "reasoning_content":
            continue
        rename = renders_reasoning and role == "assistant" and name != "reasoning_content"
        raise reject("dropped_by_template", index, f"{name} would be dropped: " + (
            "the Thinking template renders only an assistant's reasoning_content" if renders_reasoning
            else "the Instruct templates do not render reasoning") + (": rename it to reasoning_content" if rename
                                                                       else ""))
    for name, fix in UNRENDERED_FIELDS.items():
        value = message.get(name)  # a refusal's text, a call's object (a boolean flag of the same name is no such)
        if isinstance(value, (str, dict)) and value:
            raise reject("dropped_by_template", index, f"{name} would be dropped: no Qwen template renders OpenAI's "
                         f"{name}; {fix}")
    items, content_truthy = _parse_content(message, role, index)
    return Message(
        reasoning=reasoning,
        index=index,
        role=role,
        items=items,
        content_truthy=content_truthy,
        tool_calls=_parse_tool_calls(message, role, index),
        tool_call_arguments=[(call.get("function") or call)["arguments"] for call in message.get("tool_calls") or ()],
        train=train,
    )


def _parse_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise reject("bad_tools", None, "tools must be a list of function schemas (objects)")
    return tools


def _parse_conversation(messages, tools, family, template: str = "instruct") -> tuple[list[Message], list[dict]]:
    if not isinstance(messages, list) or not messages:
        got = ("the row has none" if messages is None else "got []" if messages == []
               else f"got {type(messages).__name__}")
        raise reject("no_messages", None, f"`messages` must be a non-empty list of {{role, content}} objects; {got}")
    renders_reasoning = template in family.reasoning_templates
    parsed = [_parse_message(message, index, renders_reasoning) for index, message in enumerate(messages)]
    tools = _parse_tools(tools)
    family.reject_dropped_content(parsed, tools, template)
    return parsed, tools


# ---------------------------------------------------------------------------------------------
# Rendering: the text builder and the ChatML pieces the families' renderers share
# (`preprocess.families.<family>.render`)
# ---------------------------------------------------------------------------------------------


class TextBuilder:
    """Appends text pieces while recording target spans, image sources and where data came from.

    A piece added with `where` (e.g. "messages[2].content[0].text") is data from the row;
    every other piece is the template's own markup.
    """

    def __init__(self, add_vision_id: bool = False):
        """`add_vision_id`: the templates' variable of that name, which writes `Picture n: ` /
        `Video n: ` (numbered through the conversation) before each image / video."""
        self.add_vision_id = add_vision_id
        self.labels: list[tuple[int, int]] = []  # the spans of those labels
        self.pieces: list[str] = []
        self.length = 0
        self.spans: list[list[int]] = []
        self.images: list[str] = []
        self.image_requests: list[ImageRequest] = []
        self.videos: list[VideoPart] = []
        self.data: list[tuple[int, int, str]] = []  # [start, end) of each data piece, and where

    def add(self, text: str, target: bool = False, where: str | None = None) -> None:
        if not text:
            return
        if where is not None:
            self.data.append((self.length, self.length + len(text), where))
        if target:
            if self.spans and self.spans[-1][1] == self.length:
                self.spans[-1][1] += len(text)  # extend: keep spans disjoint and few
            else:
                self.spans.append([self.length, self.length + len(text)])
        self.pieces.append(text)
        self.length += len(text)

    def add_items(self, items: list[tuple[str, str, str]], target: bool = False, text_only: bool = False) -> None:
        """Content items in order; images and videos are never targets, even inside a target turn.
        `text_only`: leave them out (system prompts render text parts only, without separators)."""
        for kind, value, where in items:
            if kind == TEXT:
                self.add(value, target, where)
            elif text_only:
                continue
            elif kind == IMAGE:
                self.images.append(value[0])
                self.image_requests.append(value[1])
                self._label(f"Picture {len(self.images)}: ")
                self.add(IMAGE_PLACEHOLDER)
            else:
                self.videos.append(value)
                self._label(f"Video {len(self.videos)}: ")
                self.add(VIDEO_PLACEHOLDER)

    def _label(self, text: str) -> None:
        """`add_vision_id`'s label of the image or video that follows: context, like the image."""
        if self.add_vision_id:
            self.labels.append((self.length, self.length + len(text)))
            self.add(text)

    def result(self) -> Rendered:
        return Rendered("".join(self.pieces), [tuple(span) for span in self.spans], self.images, self.videos,
                        self.image_requests, self.labels)


def render_tool_calls(out: TextBuilder, message: Message, target: bool, content_truthy: bool | None = None) -> None:
    for k, (name, arguments) in enumerate(message.tool_calls):
        # Template: `(loop.first and message.content) or not loop.first` -> "\n". Truthiness of
        # the raw content, so a list holding only an empty text part still gets the newline
        # (the Thinking template tests its rendered content instead: `content_truthy`).
        truthy = message.content_truthy if content_truthy is None else content_truthy
        separator = "\n" if (k > 0 or truthy) else ""
        where = f"messages[{message.index}].tool_calls[{k}].function"
        out.add(f'{separator}<tool_call>\n{{"name": "', target)
        out.add(name, target, f"{where}.name")
        out.add('", "arguments": ', target)
        out.add(arguments, target, f"{where}.arguments")
        out.add("}\n</tool_call>", target)


def render_assistant(out: TextBuilder, message: Message, target: bool) -> None:
    """Header, content, tool calls, `<|im_end|>`, "\n": only the middle three are targets."""
    out.add(IM_START + "assistant\n")
    out.add_items(message.items, target)
    render_tool_calls(out, message, target)
    out.add(IM_END, target)
    out.add("\n")


def _target_flags(messages: list[Message], loss_policy: str) -> list[bool]:
    """Which messages are trained: the policy, then each assistant message's `train` override."""
    assistant = [i for i, m in enumerate(messages) if m.role == "assistant"]
    by_policy = set(assistant) if loss_policy == "all_assistant" else set(assistant[-1:])
    return [
        m.role == "assistant" and (m.train if m.train is not None else i in by_policy) for i, m in enumerate(messages)
    ]


_LONE_SURROGATE = "[\ud800-\udfff]"


@lru_cache(maxsize=8)
def _text_check_pattern(special_tokens: frozenset[str]) -> re.Pattern:
    tokens = sorted(special_tokens | set(VISION_TOKENS), key=lambda t: (-len(t), t))  # longest first
    return re.compile("|".join([*map(re.escape, tokens), _LONE_SURROGATE]))


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text` (not valid Unicode: no UTF-8 form), or None."""
    match = re.search(_LONE_SURROGATE, text)
    return None if match is None else match.start()


def surrogate_message(char: str, where: str, offset: int) -> str:
    return (
        f"lone surrogate U+{ord(char):04X} in {where} at character {offset}: not valid Unicode; "
        "fix the source encoding"
    )


def _check_data_text(text: str, data: list[tuple[int, int, str]], special_tokens: frozenset[str]) -> None:
    """Reject special tokens and lone surrogates in the row's text, naming where they are.

    Checked on the final text, so a token formed where two pieces meet ("<|im_" + "end|>") is
    found too; a match that touches no data piece is the template's own markup.
    """
    starts = [start for start, _, _ in data]
    for match in _text_check_pattern(special_tokens).finditer(text):
        begin, end = match.span()
        first = bisect_right(starts, begin) - 1
        if first < 0 or data[first][1] <= begin:
            first += 1  # the match begins in markup; a data piece may still start inside it
        last = max(first, 0)  # the pieces the match overlaps: they start in order, up to the first past its end
        while last < len(data) and data[last][0] < end:
            last += 1
        touched = data[max(first, 0) : last]
        if not touched:
            continue
        token, (piece_start, _, where) = match.group(), touched[0]
        if len(token) == 1:
            raise reject("bad_text", None, surrogate_message(token, where, begin - piece_start))
        code = "vision_token_in_text" if token in VISION_TOKENS else "special_token_in_text"
        meaning = (
            "vision tokens may only come from image parts"
            if code == "vision_token_in_text"
            else "the tokenizer reads it as a control token, not as text, which changes the conversation's structure"
        )
        if len(touched) == 1:
            location = f"{where} holds {token} at character {begin - piece_start}"
        else:
            location = f"{token} is formed where {' and '.join(piece[2] for piece in touched)} meet"
        raise reject(code, None, f"{location}: {meaning}; remove it or write it differently (e.g. with spaces)")


def preserve_thinking_refusal(family, template: str) -> str | None:
    """Why `template` cannot render with `preserve_thinking`, and what can; None where it can."""
    if template in family.preserve_thinking_templates:
        return None
    able = ", ".join(family.preserve_thinking_templates)
    return (f"--preserve-thinking: the {template} template has no preserve_thinking variable "
            f"({'only ' + able + ' has' if able else 'no ' + family.name + ' template has'}); drop the flag"
            + (f" or preprocess with the {able} template (--profile {family.preserve_thinking_templates[-1]}, or "
               f"--model a checkpoint that has it)" if able else ""))


def reasoning_loss_refusal(family, template: str, reasoning_loss: str) -> str | None:
    """Why `reasoning_loss` other than the default has nothing to act on in `template` (a
    template that renders no reasoning); None where it acts."""
    if reasoning_loss == "train" or template in family.reasoning_templates:
        return None
    able = ", ".join(family.reasoning_templates)
    return (f"--reasoning-loss {reasoning_loss}: the {template} template renders no reasoning "
            f"({'only ' + able + ' does' if able else 'no ' + family.name + ' template does'}); drop the flag"
            + (" or preprocess with a Thinking template (its --profile, or --model a Thinking checkpoint)"
               if able else ""))


def render_conversation(
    messages: list,
    *,
    family,
    tools: list | None = None,
    loss_policy: str = "all_assistant",
    special_tokens: Collection[str] = DEFAULT_TEXT_SPECIAL_TOKENS,
    template: str = "instruct",
    reasoning_loss: str = "train",
    add_vision_id: bool = False,
    preserve_thinking: bool = False,
) -> Rendered:
    """Render OpenAI-format `messages` (and the row's `tools`) exactly as the family's official template.

    `family` is the model family (`preprocess.families.family_named(name)`, or a profile's
    `family_rules`): its template rules and renderers.
    Raises RejectError for rows that are malformed, would lose content in the template, or
    whose text holds one of `special_tokens` (or a vision token, or a lone surrogate), and
    ValueError for a template the family has not, or an unknown loss policy (job configuration,
    not data). `add_vision_id` and `preserve_thinking` are the official templates' variables of
    those names (`apply_chat_template(..., add_vision_id=True)`); only the templates in the
    family's `preserve_thinking_templates` have the second (ValueError otherwise).
    """
    if loss_policy not in LOSS_POLICIES:
        raise ValueError(f"unknown loss_policy {loss_policy!r}; choose one of {LOSS_POLICIES}")
    if template not in family.templates:
        raise ValueError(f"unknown template {template!r} for {family.name}")
    if reasoning_loss not in REASONING_LOSSES:
        raise ValueError(f"unknown reasoning_loss {reasoning_loss!r}; choose one of {REASONING_LOSSES}")
    if preserve_thinking and (refusal := preserve_thinking_refusal(family, template)):
        raise ValueError(refusal)
    parsed, tools = _parse_conversation(messages, tools, family, template)
    targets = _target_flags(parsed, loss_policy)
    out = TextBuilder(add_vision_id)
    family.render(out, parsed, tools, targets, template, reasoning_loss, preserve_thinking)
    rendered = out.result()
    _check_data_text(rendered.text, out.data, frozenset(special_tokens))
    if not rendered.target_spans:
        raise reject("no_targets", None, f"no assistant turn is a training target under loss policy {loss_policy!r}")
    return rendered


# ---------------------------------------------------------------------------------------------
# Tokenization and loss mask
# ---------------------------------------------------------------------------------------------


def tokenize_rendered(rendered: Rendered, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32 [L], one `<|image_pad|>` per image) and loss mask (uint8 [L]).

    The whole text is encoded once with add_special_tokens=False, which is what HF does after
    applying the template, so ids match HF token for token.

    Mask rule: a token is a target iff its start character offset lies inside a target span.
    Target spans start right after `<|im_start|>assistant\\n` and end right after `<|im_end|>`,
    and special tokens never merge with neighbouring text, so this is exact except at the
    start of a turn: the byte-level BPE merges the header's "\\n" with leading newlines of the
    content into one token, which starts in the header and is therefore not a target (the
    content's leading newlines are not learned; everything after them is). A token that
    overlaps one of `context_spans` is context, whatever its start: `add_vision_id`'s label
    before an image in an assistant turn may merge with the text before it (" Picture").
    """
    encoding = tokenizer.encode(rendered.text, add_special_tokens=False)
    input_ids = np.asarray(encoding.ids, dtype=np.int32)
    # (start, end) pairs flattened in C (twice as fast as np.asarray on the list of tuples)
    offsets = np.fromiter(chain.from_iterable(encoding.offsets), dtype=np.int64, count=2 * len(input_ids))
    starts = offsets[0::2]
    # Flattened span bounds [s0, e0, s1, e1, ...]: a start offset lands inside a span exactly
    # when the number of bounds <= it is odd.
    bounds = np.asarray(rendered.target_spans, dtype=np.int64).reshape(-1)
    inside = np.searchsorted(bounds, starts, side="right") & 1
    loss_mask = inside.astype(np.uint8)
    if rendered.context_spans:
        ends = offsets[1::2]
        for start, end in rendered.context_spans:
            loss_mask[(starts < end) & (ends > start)] = 0
    _check_image_pads(input_ids, loss_mask, rendered, tokenizer)
    return input_ids, loss_mask


def _check_image_pads(input_ids: np.ndarray, loss_mask: np.ndarray, rendered: Rendered, tokenizer) -> None:
    """Guarantee: one `<|image_pad|>` per image and one `<|video_pad|>` per video, none a target."""
    for token, count in (("<|image_pad|>", len(rendered.image_sources)), ("<|video_pad|>", len(rendered.videos))):
        pad = tokenizer.token_to_id(token)
        if pad is None:
            raise ConfigError(f"the tokenizer has no {token} token: not a Qwen-VL tokenizer; use the checkpoint's own "
                              "tokenizer.json")
        is_pad = input_ids == pad
        if int(is_pad.sum()) != count or loss_mask[is_pad].any():
            raise AssertionError(f"{token} must be one per {token[3:8]} and never a target; renderer invariant broken")


# ---------------------------------------------------------------------------------------------
# Template check for --model DIR
# ---------------------------------------------------------------------------------------------

_DATA_URI = "data:image/png;base64,iVBORw0KGgo="
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — température",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_CLOCK_TOOL = {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}}

# (name, messages, tools): together they exercise every branch of the official templates (the
# families reject what they cannot render; such probes are skipped for them).
TEMPLATE_PROBES: tuple[tuple[str, list, list | None], ...] = (
    (
        "system string",
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ],
        None,
    ),
    (
        "system text parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": _DATA_URI}},
                ],
            },
            {"role": "assistant", "content": "A cat."},
        ],
        None,
    ),
    (
        "no system, multi-turn",
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        None,
    ),
    (
        "multi-image user turn",
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "a.jpg"},
                    {"type": "text", "text": "compare with"},
                    {"type": "image_url", "image_url": {"url": _DATA_URI}},
                    {"type": "image", "url": "https://example.com/b.png"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]},
        ],
        None,
    ),
    (
        "videos beside an image",
        [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": "clip.mp4"},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": "a.jpg"},
                    {"type": "video", "video": ["f1.jpg", "f2.jpg"]},
                ],
            },
            {"role": "assistant", "content": "Two clips and a photo."},
        ],
        None,
    ),
    (
        "whitespace and unicode",
        [
            {"role": "user", "content": "\n  你好 👋🏽 é שלום \n"},
            {"role": "assistant", "content": "\n\n<think>ok</think>  done \n"},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
        ],
        None,
    ),
    (
        "tools with system and tool call",
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 °C."},
        ],
        [_WEATHER_TOOL],
    ),
    (
        "tools without system, string arguments, content before calls",
        [
            {"role": "user", "content": "Time and weather?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "now", "arguments": "{}"}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
                ],
            },
            {"role": "tool", "content": "12:00"},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Noon, sunny."},
        ],
        [_CLOCK_TOOL, _WEATHER_TOOL],
    ),
    (
        "bare tool call form, tool response with image",
        [
            {"role": "system", "content": [{"type": "text", "text": "Agent."}]},
            {"role": "user", "content": "Screenshot please"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "screenshot", "arguments": {}}]},
            {"role": "tool", "content": [{"type": "text", "text": "here:"}, {"type": "image", "image": "shot.png"}]},
            {"role": "assistant", "content": "Got it."},
        ],
        [{"type": "function", "function": {"name": "screenshot", "parameters": {}}}],
    ),
    (
        "tool message without tools",
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "result"},
            {"role": "assistant", "content": "done"},
        ],
        None,
    ),
    (
        "tool calls with list content",
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": ""}],
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "Cold."},
        ],
        [_WEATHER_TOOL],
    ),
    (
        "first message from tool",
        [
            {"role": "tool", "content": "boot log"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _DATA_URI}}]},
            {"role": "assistant", "content": "ok"},
        ],
        None,
    ),
    (
        "tool call arguments of every JSON type",
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {
                    "city": "Oslo", "days": 3, "metric": True, "hourly": None, "ratio": 0.5, "fields": ["t", "w"],
                    "options": {"lang": "nb"}}}}],
            },
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "Cold."},
        ],
        [_WEATHER_TOOL],
    ),
    (
        "reasoning after the last user query",
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2?"},
            {"role": "assistant", "reasoning_content": "\nadd two\n", "content": "4"},
        ],
        None,
    ),
    (
        "qwen2.5 system image and later system",
        [
            {"role": "system", "content": [{"type": "text", "text": "Ref:"}, {"type": "image", "image": "ref.png"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hey"},
            {"role": "system", "content": "Switch to French."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "salut"},
        ],
        None,
    ),
    (  # rendered by the families that keep media in assistant turns (Qwen3.5), skipped by the others
        "media in an assistant turn",
        [
            {"role": "user", "content": "Show me."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "image_url", "image_url": {"url": _DATA_URI}},
                    {"type": "video", "video": "v.mp4"},
                    {"type": "text", "text": "done"},
                ],
            },
        ],
        None,
    ),
)


def _with(variables: dict) -> str:
    return "".join(f" with {k}" for k in variables)


# Seconds the probes of a --model template may take together: the official templates render them
# in milliseconds, and a template that loops without end must not hang the job's start
TEMPLATE_CHECK_SECONDS = 60.0


class _TemplateTimeout(BaseException):
    """Raised into the template's rendering when its time is up (not an Exception: the checks
    below turn a template's own errors into ConfigError, this one into its own)."""


@contextmanager
def _time_limit(seconds: float):
    """Raise _TemplateTimeout into the code run under it after `seconds` (SIGALRM: the main
    thread of a process only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    started = time.monotonic()
    delay, interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # a caller's own timer, given back after
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if delay:
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - started), 1e-3), interval)


def _render_with_hf(template_text: str, messages: list, tools: list | None, **variables) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template_text, **variables)
    return rendered[0]


def _with_object_arguments(messages: list) -> list:
    """`messages` with each tool call's JSON-string arguments decoded (the list itself when none is
    a string)."""
    def decoded(call: dict) -> dict:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        if isinstance(call.get("arguments"), str):
            return {**call, "arguments": json.loads(call["arguments"])}
        return call

    if not any(isinstance(call, dict) and call is not decoded(call) for m in messages for call in m.get("tool_calls") or ()):
        return messages
    return [{**m, "tool_calls": [decoded(call) for call in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def template_label(family: str, template: str) -> str:
    """An official template's name in messages: the family, and the variant where the family has
    several (qwen3-vl thinking); Qwen3.5's one template is its family's name."""
    return family if template == family else f"{family} {template}"


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _excerpt(text: str, at: int, radius: int = 40) -> str:
    return repr(text[max(0, at - radius) : at + radius])


def check_template_matches(profile, template_text: str, **variables) -> None:
    """Raise ConfigError unless `template_text` renders every probe exactly like `render_conversation`,
    the template `variables` (`add_vision_id=True`, ...) set on both sides.

    Probes the family rejects (e.g. tool calls under qwen2.5-vl) are skipped for that family.
    """
    try:
        import transformers.utils.chat_template_utils  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "checking a model directory's chat template needs transformers: pip install transformers"
        ) from exc
    probe = TEMPLATE_PROBES[0][0]
    try:
        with _time_limit(TEMPLATE_CHECK_SECONDS):
            for probe, messages, tools in TEMPLATE_PROBES:
                _check_probe(profile, template_text, probe, messages, tools, variables)
    except _TemplateTimeout:
        raise ConfigError(f"the chat template of {profile.source} takes longer than {TEMPLATE_CHECK_SECONDS:g} s to "
                          f"render the probes (it was at probe {probe!r}): it is not a template vlmpack renders "
                          f"natively; use the official chat template of the checkpoint") from None


def _check_probe(profile, template_text: str, name: str, messages: list, tools: list | None, variables: dict) -> None:
    """One probe of `check_template_matches`: ConfigError unless the template renders it as vlmpack does."""
    family = profile.family
    try:
        ours = render_conversation(messages, family=profile.family_rules, tools=tools, template=profile.template,
                                   **variables).text
    except RejectError:
        return  # content this family cannot render without loss; not a template property
    try:
        try:
            theirs = _render_with_hf(template_text, messages, tools, **variables)
        except Exception:
            # a template that iterates the arguments (Qwen3.5's XML tool calls) takes no JSON
            # string: vlmpack renders such a string as its object, so compare on the object
            decoded = _with_object_arguments(messages)
            if decoded is messages:
                raise
            theirs = _render_with_hf(template_text, decoded, tools, **variables)
    except Exception as exc:  # jinja syntax or runtime errors from an arbitrary template
        raise ConfigError(
            f"the chat template of {profile.source} fails on probe {name!r} ({type(exc).__name__}: "
            f"{(str(exc).strip().splitlines() or [''])[0]}); "
            f"it is not a template vlmpack renders natively (the official {template_label(family, profile.template)} "
            f"template)"
        ) from exc
    if theirs != ours:
        at = _first_difference(theirs, ours)
        raise ConfigError(
            f"the chat template of {profile.source} is not one vlmpack renders natively: it differs from the "
            f"official {template_label(family, profile.template)} template on probe {name!r}{_with(variables)} at character {at}: "
            f"the template gives ...{_excerpt(theirs, at)}..., vlmpack gives ...{_excerpt(ours, at)}...; "
            f"use the official chat template of the checkpoint (sha256 of the supported templates is in "
            f"preprocess.profiles.OFFICIAL_TEMPLATE_SHA256)"
        )
