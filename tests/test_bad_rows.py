"""Rows that must be rejected with a named code, never killing or hanging the batch job:
invalid ids, broken Unicode, blank lines, and (in the batch test at the end) every bad kind
of row and media together with good rows."""

from __future__ import annotations

import pytest

from preprocess.errors import RejectError
from preprocess.pipeline import SampleOptions, process_row

GOOD_MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def _process(row: dict, profile, **options):
    return process_row(row, sample_uid="in.jsonl:0", source="in.jsonl:0", profile=profile,
                       options=SampleOptions(**options))


@pytest.mark.parametrize(
    "row_id, needle",
    [
        ("\ud800", "lone surrogate U+D800 in `id` at character 0"),
        ("ok\udc80", "lone surrogate U+DC80 in `id` at character 2"),
        ([1, 2], "got list"),
        ({"a": 1}, "got dict"),
        (1.5, "got float"),
        (True, "got bool"),
    ],
)
def test_bad_ids_are_rejected(builtin_profiles, row_id, needle):
    with pytest.raises(RejectError) as err:
        _process({"id": row_id, "messages": GOOD_MESSAGES}, builtin_profiles["qwen3-vl"])
    assert err.value.code == "bad_id"
    assert needle in err.value.message
    err.value.message.encode("utf-8")  # the reason itself is writable


@pytest.mark.parametrize("row_id, uid", [("conv-7", "conv-7"), (7, "7"), ("", "in.jsonl:0"), (None, "in.jsonl:0")])
def test_good_ids_name_the_sample(builtin_profiles, row_id, uid):
    assert _process({"id": row_id, "messages": GOOD_MESSAGES}, builtin_profiles["qwen3-vl"]).sample_uid == uid
