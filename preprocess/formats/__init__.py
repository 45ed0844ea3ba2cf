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
"""

from __future__ import annotations

from ..errors import RejectError
from . import sharegpt, swift

ROW_FORMATS = ("openai", "sharegpt", "swift")
INPUT_FORMATS = ("auto", *ROW_FORMATS)
MEDIA_KEYS = ("images", "videos", "image", "video")


def detect_row_format(row) -> str:
    """The layout of `row` (a dict, or the column names of a table input)."""
    keys = set(row) if isinstance(row, (dict, list, tuple, set)) else set()
    if "conversations" in keys:
        return "sharegpt"
    if "messages" in keys and any(k in keys and (not isinstance(row, dict) or row[k] is not None) for k in MEDIA_KEYS):
        return "swift"
    return "openai"


def to_openai_row(row, row_format: str) -> dict:
    """`row` in the OpenAI layout (`id`, `messages`, `tools`); an OpenAI row is returned as is."""
    if not isinstance(row, dict):
        raise RejectError("bad_row", f"a row must be a JSON object, got {type(row).__name__}")
    if row_format == "openai":
        return row
    if row_format == "sharegpt":
        return sharegpt.to_openai(row)
    if row_format == "swift":
        return swift.to_openai(row)
    raise ValueError(f"unknown row format {row_format!r}: choose one of {ROW_FORMATS}")
