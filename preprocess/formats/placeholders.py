"""`<image>` / `<video>` placeholders in message text -> content parts, media taken in order.

The layouts that carry media beside the conversation (ShareGPT, ms-swift) mark where each
image and video goes with a placeholder in the text; the k-th `<image>` of the row is the k-th
entry of its image list. The text around a placeholder is kept byte for byte (LLaVA's
`<image>\\n` keeps its newline), as those projects substitute the vision tokens in place.
"""

from __future__ import annotations

import re

from ..errors import RejectError

PLACEHOLDER = re.compile(r"<(image|video)>")


class MediaQueue:
    """A row's image and video lists, consumed in order of the placeholders."""

    def __init__(self, images, videos):
        self.media = {"image": _as_list(images, "images"), "video": _as_list(videos, "videos")}
        self.used = {"image": 0, "video": 0}

    @classmethod
    def from_row(cls, row: dict) -> "MediaQueue":
        """The row's `images` / `videos` lists (LLaVA's single `image` / `video` as one-element
        lists). A row giving both spellings must name the same media in them: else one list
        would be dropped unseen."""
        queue = cls(None, None)
        refuse_audio(row)
        for kind in ("image", "video"):
            given = [(key, _as_list(row[key], key)) for key in (f"{kind}s", kind) if row.get(key) is not None]
            if len(given) == 2 and given[0][1] != given[1][1]:
                raise RejectError("placeholder_mismatch", f"the row has both `{kind}s` and LLaVA's `{kind}`, naming "
                                  f"different {kind}s: keep one of them")
            queue.media[kind] = given[0][1] if given else []
        return queue

    def take(self, kind: str):
        k = self.used[kind]
        items = self.media[kind]
        self.used[kind] += 1
        return items[k] if k < len(items) else None

    def check_all_used(self) -> None:
        for kind in ("image", "video"):
            used, given = self.used[kind], len(self.media[kind])
            if used != given:
                raise RejectError("placeholder_mismatch", f"the row has {used} <{kind}> placeholder(s) but {given} "
                                  f"{kind}(s) in its {kind}s list: each {kind} needs one <{kind}> in the text, in order")


def refuse_audio(row: dict) -> None:
    """ms-swift's and ShareGPT's audio lists: rejected, never dropped unseen."""
    for key in ("audios", "audio"):
        if row.get(key) not in (None, "", []):
            raise RejectError("unsupported_field", f"`{key}`: Qwen vision-language models take no audio; drop the "
                              "audio (and its <audio> tags) from the row")


def _as_list(value, name: str) -> list:
    if value is None or value == "":  # a table's empty cell: the row has none
        return []
    if isinstance(value, (str, bytes, dict)):  # LLaVA's single `image`, or one HF Image feature
        _check_reference(value, f"`{name}`", name)
        return [value]
    if isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            if item is None or item == "":
                what = "null" if item is None else "an empty string"
                raise RejectError("empty_source", f"`{name}[{k}]` is {what}: give each entry of `{name}` a path, "
                                  "data URI or base64, or drop the entry and its placeholder")
            if not (name.startswith("video") and isinstance(item, list)):  # a video's frames: checked as its part
                _check_reference(item, f"`{name}[{k}]`", name)
        return list(value)
    raise RejectError("bad_row", f"`{name}` must be a list of media references, got {type(value).__name__}")


def _check_reference(item, where: str, name: str) -> None:
    """A media reference as `preprocess.media` reads one: a string, raw bytes, or an HF Image
    feature's {"bytes", "path"} with bytes or a path string."""
    if isinstance(item, dict):
        if item.get("bytes") is not None or (isinstance(item.get("path"), str) and item["path"]):
            return
        shown = f"an object ({str(item)[:60]}) without bytes or a path"
    elif isinstance(item, (str, bytes, bytearray)):
        return
    else:
        shown = f"{str(item)[:60]}, " + {list: "a list", bool: "a boolean"}.get(type(item), "a number")
    raise RejectError("bad_content", f"{where} is {shown}: give each entry of `{name}` a path, URL, data URI or "
                      "base64 string (or an image feature's {\"bytes\", \"path\"})")


def split_text(text: str, queue: MediaQueue) -> str | list[dict]:
    """`text` unchanged when it holds no placeholder, else its parts: text pieces (empty ones
    dropped) and an image or video part per placeholder."""
    if "<image>" not in text and "<video>" not in text:
        return text
    parts, at = [], 0
    for match in PLACEHOLDER.finditer(text):
        if match.start() > at:
            parts.append({"type": "text", "text": text[at : match.start()]})
        kind = match.group(1)
        source = queue.take(kind)
        if source is None:
            given = len(queue.media[kind])
            raise RejectError("placeholder_mismatch", f"<{kind}> placeholder number {queue.used[kind]} has no {kind}: "
                              f"the row's {kind}s list holds {given}")
        parts.append({"type": kind, kind: source})
        at = match.end()
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return parts


def system_turn(row: dict) -> dict | None:
    """The system message of a row's top-level `system` (ShareGPT's, and ms-swift's beside
    `messages`), or None where it has none. Placeholders there would match no media: the
    layouts take media in the user turns."""
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RejectError("bad_content", f"`system` must be a string, got {type(system).__name__}")
    if not system:
        return None
    if (found := PLACEHOLDER.search(system)) is not None:
        raise RejectError("placeholder_mismatch", f"`system` holds a {found.group()} placeholder, which is read only "
                          "in the conversation's turns: move it into a user turn")
    return {"role": "system", "content": system}
