"""Row layouts users have, turned into the OpenAI `messages` rows the renderer takes.

* `openai`: `messages` with string or part-list content, images and videos inside the parts
  (vlmpack's own layout; the row is used as it is);
* `sharegpt`: LLaMA-Factory's ShareGPT layout, which LLaVA and Qwen's own fine-tuning scripts
  also write: `conversations` of `{"from", "value"}`, `<image>` / `<video>` placeholders in the
  text matched in order to `images` / `videos` (or LLaVA's single `image` / `video`), an
  optional top-level `system` and `tools` (`sharegpt.py`);
* `swift`: ms-swift's layout, `messages` with string content holding `<image>` / `<video>` tags
  plus `images` / `videos` lists; part-list content whose `{"type": "image"}` parts carry no
  source (the Hugging Face / TRL layout) takes them from the same lists (`swift.py`).

`detect_row_format` names the layout of one row (the first of an input: every input has one
layout, recorded in the job identity); `to_openai_row` converts a row, raising `RejectError`
with a named code when it cannot (`placeholder_mismatch`, `unknown_role`, `bad_row`, ...).
A row of another layout than the one named (`messages` read as ShareGPT, `conversations` as
OpenAI, ms-swift's media lists or `loss` read as OpenAI) is rejected naming the --input-format
that reads it. A conversation stored as the JSON
text of its list (`messages` / `conversations` as a string column, as many exported Parquet
datasets hold it) is read as that list, in every input format alike.
"""

from __future__ import annotations

import re

from ..errors import RejectError, loads_or_reject
from . import sharegpt, swift
from .placeholders import refuse_audio

ROW_FORMATS = ("openai", "sharegpt", "swift")
INPUT_FORMATS = ("auto", *ROW_FORMATS)
MEDIA_KEYS = ("images", "videos", "image", "video")
TURNS_KEY = {"openai": "messages", "sharegpt": "conversations", "swift": "messages"}  # where each keeps its turns


def detect_row_format(row) -> str:
    """The layout of `row` (a dict, or the column names of a table input)."""
    keys = set(row) if isinstance(row, dict) else \
        {k for k in row if isinstance(k, str)} if isinstance(row, (list, tuple, set)) else set()
    if "conversations" in keys:
        return "sharegpt"
    # ms-swift's media lists, or its top-level system (which the OpenAI layout has not), beside messages
    if "messages" in keys and any(k in keys and (not isinstance(row, dict) or row[k] is not None)
                                  for k in (*MEDIA_KEYS, "system")):
        return "swift"
    return "openai"


def to_openai_row(row, row_format: str, *, detected: bool = False) -> dict:
    """`row` in the OpenAI layout (`id`, `messages`, `tools`); an OpenAI row is returned as is
    (but for a conversation given as JSON text, which is parsed). `detected`: `row_format` was
    taken from the input's first row by --input-format auto, which a reject's fix names."""
    if not isinstance(row, dict):
        raise RejectError("bad_row", f"a row must be a JSON object, got {type(row).__name__}")
    key = TURNS_KEY.get(row_format, "messages")
    if row.get("messages") is not None and row.get("conversations") is not None:  # one would go unread
        raise RejectError("bad_row", "the row holds both `messages` and `conversations`, the turns of two layouts: "
                          "keep one of them")
    if row.get(key) is None:
        _reject_other_layout(row, row_format, detected)
    elif isinstance(row[key], str):
        row = {**row, key: _turns_from_json_text(row[key], key)}
    if row_format == "openai":
        _reject_swift_fields(row)
        return row
    if row_format == "sharegpt":
        return sharegpt.to_openai(row)
    if row_format == "swift":
        return swift.to_openai(row)
    raise ValueError(f"unknown row format {row_format!r}: choose one of {ROW_FORMATS}")


def in_row_terms(exc: RejectError, row, row_format: str) -> RejectError:
    """`exc`, raised on the converted row, naming turns as the user's row does: a ShareGPT row's
    message k is its conversations[k], or conversations[k - 1] after a top-level `system`; an
    ms-swift row's message k is its messages[k - 1] after one."""
    if row_format not in ("sharegpt", "swift") or not isinstance(row, dict):
        return exc
    offset = 1 if isinstance(row.get("system"), str) and row["system"] else 0
    if row_format == "swift" and not offset:
        return exc
    key, field = ("conversations", ".value") if row_format == "sharegpt" else ("messages", ".content")

    def turn(match: re.Match) -> str:  # an OpenAI message's `content` is a ShareGPT turn's `value`
        k = int(match[1]) - offset
        return "`system`" if k < 0 else f"{key}[{k}]" + (field if match[2] else "")

    message = re.sub(r"^message (\d+)()(?=:)", turn, exc.message)
    return RejectError(exc.code, re.sub(r"\bmessages\[(\d+)\](\.content\b)?", turn, message))


def _reject_other_layout(row: dict, row_format: str, detected: bool) -> None:
    """A RejectError naming the --input-format that reads `row` when it holds the turns of
    another layout than `row_format`'s (a whole input named with the wrong flag rejects every
    row, so each reject says the fix); nothing when it holds neither. Under auto the input's
    layout came from its first row, so the fix is one layout per input."""
    if row_format == "sharegpt" and row.get("messages") is not None:
        other = detect_row_format(row)
        turns = " with `role` / `content`" if _first_turn_has(row["messages"], "role") else ""
        raise RejectError("no_messages", f"the row has no `conversations` (the ShareGPT turns that --input-format "
                          f"sharegpt reads) but has `messages`{turns}, the {_LAYOUT_NAMES[other]} layout: "
                          f"{_layout_fix(other, row_format, detected)}")
    if row_format != "sharegpt" and row.get("conversations") is not None:
        turns = " with `from` / `value`" if _first_turn_has(row["conversations"], "from") else ""
        raise RejectError("no_messages", f"the row has no `messages` (the turns that --input-format {row_format} "
                          f"reads) but has `conversations`{turns}, the ShareGPT layout: "
                          f"{_layout_fix('sharegpt', row_format, detected)}")


def _layout_fix(other: str, row_format: str, detected: bool) -> str:
    if detected:
        return (f"--input-format auto read this input as {row_format}, the layout of its first row with turns: put "
                "rows of each layout in an input of their own")
    return f"use --input-format {other}, or auto to detect each input's layout"


def _reject_swift_fields(row: dict) -> None:
    """An OpenAI row carries its media in its parts. Media lists beside `messages`, or a
    message's `loss`, are ms-swift's: read as OpenAI they would be dropped unseen (auto takes an
    input's layout from its first row, which may hold no media)."""
    refuse_audio(row)
    if row.get("system") not in (None, ""):
        raise RejectError("unsupported_field", "`system` beside `messages` is not read in the OpenAI layout: make it "
                          "the first message, {\"role\": \"system\", \"content\": ...}, or use --input-format swift, "
                          "which reads it so")
    for key in MEDIA_KEYS:
        if row.get(key) not in (None, "", []):
            raise RejectError("unsupported_field", f"`{key}` beside `messages` is the ms-swift layout, which "
                              "--input-format openai does not read (auto takes an input's layout from its first "
                              "row): use --input-format swift")
    messages = row.get("messages")
    for k, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict) and message.get("loss") is not None:
            raise RejectError("unsupported_field", f"messages[{k}].loss is ms-swift's key, which --input-format "
                              "openai does not read: use --input-format swift, or the OpenAI layout's `train` flag")


_LAYOUT_NAMES = {"openai": "OpenAI", "swift": "ms-swift (`messages` plus `images` / `videos` lists)"}


def _first_turn_has(turns, field: str) -> bool:
    if isinstance(turns, str):
        try:
            turns = _turns_from_json_text(turns, "")
        except RejectError:
            return False
    return isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and field in turns[0]


def _turns_from_json_text(text: str, key: str) -> list:
    """The list a string `messages` / `conversations` holds as JSON text. Turns are never a
    string otherwise, so JSON text of a list is unambiguous; other text is rejected."""
    if not text.lstrip().startswith("["):
        raise RejectError("no_messages", f"`{key}` is a string ({len(text):,} characters, starting {text[:40]!r}), "
                          f"not a list of turns: write `{key}` as a list of turn objects, or as the JSON text of one")
    try:  # text starting with `[` that parses is a list
        return loads_or_reject(text, "bad_json", f"`{key}`, a string read as the JSON text of its list of turns,")
    except RejectError as exc:
        raise RejectError(exc.code, f"{exc.message}; write `{key}` as a list of turn objects, or as valid JSON "
                          "text of one") from None
