"""Why a row was rejected: a short machine-readable code plus a message naming the fix.

Every per-row failure in the preprocessing stage is raised as `RejectError`; the batch job
catches it, writes one line to `rejects.jsonl` and goes on with the next row.
"""

from shards_schema.errors import UserError


class RejectError(Exception):
    """A row that cannot become a training sample. `code` groups rejects in reports."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConfigError(UserError):
    """A job-level mistake (bad --model dir, unknown profile, bad flags): fail before any work."""
