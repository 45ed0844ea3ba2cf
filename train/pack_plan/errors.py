"""The planner's error."""

from __future__ import annotations

from shards_schema.errors import UserError


class PackingError(UserError, ValueError):
    """The samples cannot be packed under the given settings (the message names the fix)."""
