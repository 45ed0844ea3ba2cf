"""Why a row was rejected: a short machine-readable code plus a message naming the fix.

Every per-row failure in the preprocessing stage is raised as `RejectError`; the batch job
catches it, writes one line to `rejects.jsonl` and goes on with the next row.
"""

import json
import re
import sys

from shards_schema.errors import UserError


class RejectError(Exception):
    """A row that cannot become a training sample. `code` groups rejects in reports."""

    def __init__(self, code: str, message: str):
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
