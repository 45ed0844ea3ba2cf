"""Rows that must be rejected with a named code, never killing or hanging the batch job:
invalid ids, broken Unicode, blank lines, and (in the batch test at the end) every bad kind
of row and media together with good rows."""

from __future__ import annotations

import base64

import pytest

from preprocess.errors import RejectError
from preprocess.pipeline import SampleOptions, process_row
from tests.test_images import png_header_only  # tiny file, huge header: fails if its pixels are decoded

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


def image_row(uri: str, text: str = "What is it?") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": "A picture."},
        ]
    }


@pytest.mark.parametrize("truncate", [False, True])
def test_length_is_checked_from_image_headers_before_decoding(builtin_profiles, truncate):
    """A 13000x13000 image under the pixel limit in a row too long for --max-seq-len is rejected
    as too_long from its header size alone: its pixels (1.1 GB decoded) are never decoded."""
    uri = "data:image/png;base64," + base64.b64encode(png_header_only(13000, 13000)).decode()
    with pytest.raises(RejectError) as err:
        _process(image_row(uri), builtin_profiles["qwen3-vl"], max_seq_len=2000, truncate=truncate)
    assert err.value.code == "too_long", err.value
    # under a sequence length that fits, the same row gets as far as decoding, which fails
    with pytest.raises(RejectError) as err:
        _process(image_row(uri), builtin_profiles["qwen3-vl"], max_seq_len=10**6)
    assert err.value.code == "bad_image" and err.value.message.startswith("image 0: ")
