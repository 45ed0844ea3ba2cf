"""The one reading of a file that must hold a JSON object (a manifest, a model's config.json,
a checkpoint's metadata): what the error says when it does not, the same everywhere. Each
caller wraps the message in its own error, with the way on that fits its file."""

from __future__ import annotations

import json


class NotAJSONObject(ValueError):
    """Text that does not parse as JSON, or holds another value than an object; the message
    names where the text came from and what is wrong with it."""


def _json_kind(value) -> str:
    """The JSON name of a parsed value's kind: object, array, string, number, boolean or null."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


def parse_json_object(text: str | bytes, where) -> dict:
    """The object JSON `text` (bytes: UTF-8) holds; NotAJSONObject naming `where` otherwise."""
    try:
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise NotAJSONObject(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of thousands of digits
        raise NotAJSONObject(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise NotAJSONObject(f"{where}: holds a JSON {_json_kind(value)}, not an object")
    return value
