"""Why a row was rejected: a short machine-readable code plus a message naming the fix.

Every per-row failure in the preprocessing stage is raised as `RejectError`; the batch job
catches it, writes one line to `rejects.jsonl` and goes on with the next row.
"""

import json
import re
import sys

from shards_schema.errors import UserError


# Every reason a row can be rejected for, with what it means: `RejectError` takes only these,
# and docs/preprocessing.md's "Reject codes" tables list exactly these (tests/test_docs_codes.py).
REJECT_CODES = {
    # rows
    "bad_json": "not valid JSON or UTF-8, too deeply nested, an integer too long, or the element where a JSON file is cut",
    "bad_row": "not a JSON object with `messages`",
    "bad_id": "an `id` that is not a string or an integer, or holds a lone surrogate",
    "row_too_large": "more bytes than --max-row-bytes (skipped unread)",
    "unreadable_row": "a Parquet row group or Arrow data that cannot be read",
    "no_messages": "no messages",
    "bad_message": "a message that is not an object, or a malformed field of one",
    "unknown_role": "a role the chat template does not render",
    "bad_content": "content of a kind or in a place the template cannot render",
    "bad_text": "a lone surrogate: not valid Unicode",
    "bad_tool_call": "a malformed tool call",
    "bad_tools": "tool schemas that are not a list of objects",
    "dropped_by_template": "content the official template would silently leave out",
    "vision_token_in_text": "a literal vision token in text",
    "special_token_in_text": "a literal special token of the tokenizer in text",
    "no_targets": "no assistant turn is a training target",
    "too_long": "more tokens than --max-seq-len",
    "placeholder_mismatch": "ShareGPT / ms-swift placeholders and media lists disagree",
    "image_count_mismatch": "image or video pad tokens in the text and the row's images or videos disagree in number",
    "unsupported_field": "a field vlmpack does not apply",
    "internal_error": "an unexpected error while processing the row (a bug: please report it)",
    # images
    "empty_source": "an empty image or video reference",
    "remote_url": "a URL without --allow-remote-media",
    "bad_data_uri": "a malformed data URI",
    "bad_base64": "malformed base64",
    "no_media_root": "a path without --media-root",
    "path_outside_media_root": "a path that leaves --media-root",
    "bad_path": "a path that cannot name a file",
    "missing_file": "no such file",
    "not_a_regular_file": "a directory, FIFO, socket or device",
    "unreadable_file": "a file that cannot be read",
    "media_too_large": "more bytes than --max-media-bytes / --max-video-bytes",
    "not_an_image": "not a picture format PIL opens",
    "mime_mismatch": "a data URI whose type names another kind of media",
    "animated_image": "an animated GIF, PNG or WebP",
    "image_too_large": "more pixels than --max-image-pixels",
    "bad_image": "a truncated or corrupt image",
    "unsupported_mode": "a PIL mode that does not convert to RGB",
    "aspect_ratio": "a longer side more than 200 times the shorter",
    "bad_image_option": "an image part's min_pixels / max_pixels out of range",
    # remote media
    "remote_not_found": "no such object (HTTP 404)",
    "remote_denied": "refused credentials (HTTP 401/403)",
    "remote_unreachable": "no answer within --remote-timeout, a refused connection or a server error",
    # videos
    "not_a_video": "not a container FFmpeg opens, or a still image",
    "no_video_stream": "a container without a video stream",
    "unsupported_codec": "a codec PyAV cannot decode",
    "bad_video": "a damaged stream or frame list",
    "frame_too_large": "frames of more pixels than --max-image-pixels",
    "bad_video_option": "a video part's option out of range",
    "video_sampling": "a window or frame count the reference processor refuses",
    "video_too_long": "more tokens than --max-seq-len from the video alone",
    "no_video_decoder": "PyAV is not installed",
}


def check_reject_code(code: str) -> str:
    """`code` if it is in REJECT_CODES; a ValueError otherwise, so that a misspelt or new code
    fails where it is written instead of reaching rejects.jsonl undocumented."""
    if code not in REJECT_CODES:
        raise ValueError(f"reject code {code!r} is not in preprocess.errors.REJECT_CODES: add it there, with its "
                         "meaning, and to docs/preprocessing.md's reject codes")
    return code


class RejectError(Exception):
    """A row that cannot become a training sample. `code` (one of REJECT_CODES) groups rejects in reports."""

    def __init__(self, code: str, message: str):
        check_reject_code(code)
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConfigError(UserError):
    """A job-level mistake (bad --model dir, unknown profile, bad flags): fail before any work."""


_INT_DIGITS = re.compile(r"integer string conversion")


def loads_or_reject(text: str | bytes, code: str, what: str):
    """The JSON value of `text`, or a RejectError with `code` saying why there is none: not JSON
    or not UTF-8, nested deeper than the parser allows, or an integer too long to convert (the
    parser's own errors for those two are not JSON errors, and would end the job)."""
    if isinstance(text, (bytes, bytearray)):  # json.loads would guess UTF-16 or UTF-32 for bytes that are not UTF-8
        try:
            text = bytes(text).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise RejectError(code, f"{what} is not UTF-8 text: byte {exc.start} (0x{exc.object[exc.start]:02x}), "
                                    f"{exc.reason}; JSON rows are UTF-8") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise RejectError(code, f"{what} is nested deeper than the JSON parser allows (about "
                          f"{sys.getrecursionlimit()} levels)") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if _INT_DIGITS.search(str(exc)):
            raise RejectError(code, f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits; "
                              "write such a number as a string") from None
        raise RejectError(code, f"{what} is not valid JSON: {exc}") from None
