"""Random conversations in every accepted spelling, the messages as the official templates take
them, and the loss mask expected of a rendering, read from the token ids alone."""

from __future__ import annotations

import base64
import json
import random
import re

import numpy as np

# Text fragments joined at random: unicode of every kind (CJK, emoji with modifiers, combining
# marks, RTL, characters NFC rewrites), whitespace at the edges, and strings that are tokens.
FRAGMENTS = [
    "Hello",
    "What is in this image?",
    "The answer is 42.",
    "你好，世界",
    "日本語のテキスト",
    "한국어",
    "👋🏽",
    "🎉✨🧑‍🚀",
    "e\u0301",
    "A\u030a",
    "\u212b",
    "n\u0303o",
    "שלום עולם",
    "مرحبا بالعالم",
    "a\u200bb",
    "ﬁ",
    "’quotes’ “double”",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    '{"a": 1}',
    "x = 1\nprint(x)\n",
    "  ",
    " ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "...",
]


def rand_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.choice([0, 1, 1, 2, 3, 4])))


def rand_image_part(rng: random.Random) -> tuple[dict, str]:
    """An image part in one of the accepted spellings, and the source the renderer must report."""
    n = rng.randrange(10**6)
    uri = "data:image/png;base64," + base64.b64encode(n.to_bytes(4, "big") * 3).decode()
    part = rng.choice(
        [
            {"type": "image_url", "image_url": {"url": uri}},
            {"type": "image_url", "image_url": uri},
            {"type": "image", "image": f"images/{n}.jpg"},
            {"type": "image", "url": f"https://example.com/{n}.png"},
            {"type": "image", "path": f"/data/{n}.png"},
        ]
    )
    source = part.get("image_url", part.get("image", part.get("url", part.get("path"))))
    return part, source["url"] if isinstance(source, dict) else source


def rand_video_part(rng: random.Random) -> tuple[dict, object]:
    """A video part in one of the accepted spellings (with sampling options sometimes), and the
    source the renderer must report."""
    n = rng.randrange(10**6)
    source = rng.choice([f"videos/{n}.mp4", f"/data/{n}.webm", "data:video/mp4;base64," + "AAAA" * 80,
                         [f"frames/{n}/{k}.jpg" for k in range(rng.randint(1, 6))]])
    part = {"type": "video", "video": source}
    if isinstance(source, str) and rng.random() < 0.3:
        part = {"type": "video_url", "video_url": {"url": source}}
    if rng.random() < 0.4:
        part.update(rng.choice([{"fps": 1.0}, {"nframes": 8}, {"max_pixels": 128 * 28 * 28, "min_frames": 2},
                                {"video_start": 1.5, "video_end": 4.0}]))
    return part, source


def hf_template_messages(messages: list) -> list:
    """The messages as the official templates understand them: they render `{"type": "video"}`
    parts but not OpenAI-style `video_url` parts, which vlmpack renders as the video they are."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "video", "video": part["video_url"]["url"]} if part.get("type") == "video_url" else part
                       for part in content]
            message = {**message, "content": content}
        out.append(message)
    return out


def rand_content(rng: random.Random, images: bool, sources: list):
    """A string, or a list of text parts (and image and video parts when `images`); each visual
    source goes into `sources`, a video's as ("video", source)."""
    if rng.random() < 0.4:
        return rand_text(rng)
    parts = []
    for _ in range(rng.randint(1, 4)):
        if images and rng.random() < 0.1:
            part, source = rand_video_part(rng)
            parts.append(part)
            sources.append(("video", source))
        elif images and rng.random() < 0.4:
            part, source = rand_image_part(rng)
            parts.append(part)
            sources.append(source)
        else:
            parts.append({"type": "text", "text": rand_text(rng)})
    return parts


def rand_tools(rng: random.Random) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "description": rand_text(rng),
                "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "查询 🔍"}}},
            },
        }
        for k in range(rng.randint(1, 3))
    ]


def rand_tool_call(rng: random.Random, tools: list[dict]) -> dict:
    name = rng.choice(tools)["function"]["name"]
    args = {"q": rand_text(rng), "n": rng.randint(0, 9), "nested": {"ok": rng.random() < 0.5, "l": [1, "二"]}}
    if rng.random() < 0.5:
        args = json.dumps(args, ensure_ascii=rng.random() < 0.5)  # OpenAI: a JSON string, rendered verbatim
    if rng.random() < 0.3:
        return {"name": name, "arguments": args}  # the bare form the template also accepts
    return {"id": f"call_{rng.randrange(999)}", "type": "function", "function": {"name": name, "arguments": args}}


def maybe_train_flag(rng: random.Random, message: dict) -> dict:
    roll = rng.random()
    if roll < 0.1:
        message["train"] = False
    elif roll < 0.15:
        message["train"] = True
    return message


def rand_assistant(rng: random.Random, family: str, sources: list[str]) -> dict:
    content = rand_content(rng, images=family == "qwen2.5-vl" and rng.random() < 0.2, sources=sources)
    return maybe_train_flag(rng, {"role": "assistant", "content": content})


def rand_tool_round(rng: random.Random, tools: list[dict], sources: list[str]) -> list[dict]:
    """qwen3-vl: assistant tool calls, 1-3 (consecutive) tool results, a final answer."""
    content = rng.choice([None, "", rand_text(rng), [{"type": "text", "text": rand_text(rng)}]])
    calls = [rand_tool_call(rng, tools) for _ in range(rng.randint(1, 3))]
    messages = [maybe_train_flag(rng, {"role": "assistant", "content": content, "tool_calls": calls})]
    for k in range(rng.randint(1, 3)):
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": rand_content(rng, True, sources)})
    messages.append(rand_assistant(rng, "qwen3-vl", sources))
    return messages


def rand_system(rng: random.Random, family: str, sources: list[str]) -> dict:
    if rng.random() < 0.5:
        return {"role": "system", "content": rand_text(rng)}
    images = family == "qwen2.5-vl" and rng.random() < 0.3  # qwen3-vl would drop them (rejected)
    return {"role": "system", "content": rand_content(rng, images, sources) or [{"type": "text", "text": ""}]}


def rand_conversation(rng: random.Random, family: str):
    """(messages, tools, image sources in order) for one random conversation."""
    messages, sources = [], []
    roll = rng.random()
    if roll < 0.6:
        messages.append(rand_system(rng, family, sources))
    elif roll < 0.65:
        messages.append(
            {"role": "tool", "content": rand_content(rng, True, sources)}
        )  # a row starting with a tool result
    tools = rand_tools(rng) if family == "qwen3-vl" and rng.random() < 0.35 else None
    for _ in range(rng.randint(1, 3)):
        for _ in range(rng.choice([1, 1, 1, 2])):  # sometimes two user turns in a row
            messages.append({"role": "user", "content": rand_content(rng, True, sources)})
        if family == "qwen2.5-vl" and rng.random() < 0.1:  # qwen2.5-vl renders later system and tool turns
            messages.append({"role": rng.choice(["system", "tool"]), "content": rand_content(rng, True, sources)})
        if tools and rng.random() < 0.6:
            messages.extend(rand_tool_round(rng, tools, sources))
        else:
            messages.append(rand_assistant(rng, family, sources))
    if tools is None and rng.random() < 0.05:
        tools = []  # an empty list is falsy in the template: no tools block
    return messages, tools, sources


def expected_trained(messages: list, policy: str) -> list[bool]:
    """Per assistant message, in order: is it a target under `policy` and the `train` overrides."""
    assistant = [m for m in messages if m["role"] == "assistant"]
    flags = [policy == "all_assistant" or k == len(assistant) - 1 for k in range(len(assistant))]
    return [m.get("train", flag) for m, flag in zip(assistant, flags, strict=True)]


def expected_mask_from_ids(ids: list[int], trained: list[bool], tokenizer, vision_id_text: str | None = None) -> np.ndarray:
    """Mask from token ids alone: for the k-th `<|im_start|> assistant` pair, if trained, every
    token after the header's newline token up to and including the next `<|im_end|>`, minus
    vision tokens. The header's newline token may have absorbed leading newlines of the content.
    `vision_id_text`: HF's text rendered with `add_vision_id`, whose `Picture n: ` / `Video n: `
    before each image or video belong to it, never a target (no token reaching into one)."""
    im_start, im_end, assistant = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "assistant"])
    vision = set(tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"]))
    mask = np.zeros(len(ids), dtype=np.uint8)
    turn = 0
    for i in range(len(ids) - 2):
        if ids[i] == im_start and ids[i + 1] == assistant:
            assert tokenizer.decode([ids[i + 2]]).startswith("\n")
            end = ids.index(im_end, i + 2)
            if trained[turn]:
                mask[i + 3 : end + 1] = 1
            turn += 1
    assert turn == len(trained)
    mask[np.isin(np.asarray(ids), list(vision))] = 0
    if vision_id_text is not None:
        encoding = tokenizer(vision_id_text, add_special_tokens=False, return_offsets_mapping=True)
        assert encoding["input_ids"] == list(ids)
        labels = [m.span() for m in re.finditer(r"(?:Picture|Video) \d+: (?=<\|vision_start\|>)", vision_id_text)]
        for k, (start, end) in enumerate(encoding["offset_mapping"]):
            if any(start < b and end > a for a, b in labels):
                mask[k] = 0
    return mask

