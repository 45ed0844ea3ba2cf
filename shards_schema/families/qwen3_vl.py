"""Qwen3-VL's rules of the shard contract.

A video is written as HF's `Qwen3VLProcessor.replace_video_token` writes it: per temporal group
(`temporal_patch_size` frames), its timestamp `<t.t seconds>` as plain text, then
`<|vision_start|>`, the group's h*w/m^2 pads and `<|vision_end|>`; the chat template's own
`<|vision_start|>` / `<|vision_end|>` stay around the whole video. `get_rope_index` gives each
group its own vision run (t = 1), so the text between groups moves the positions on and a
group's temporal position is its run's start. The bundled Qwen3 tokenizer is Qwen3-VL's own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..positions import VideoPositions, token_runs

TIMESTAMP_TEXT = re.compile(r"<(\d+\.\d) seconds>")  # a group's timestamp, as the processor writes it


def timestamp_text(seconds: float) -> str:
    """A temporal group's timestamp text (`Qwen3VLProcessor`: `f"<{t:.1f} seconds>"`)."""
    return f"<{seconds:.1f} seconds>"


class Qwen3VLRules:
    """Qwen3-VL: each temporal group of a video is its own vision run, after its timestamp text."""

    name = "qwen3-vl"

    def video_positions(self, *, video_pad_id, video_grid_thw, second_per_grid_ts, tokens_per_second) -> VideoPositions:
        return VideoPositions(video_pad_id=video_pad_id, video_grid_thw=video_grid_thw,
                              second_per_grid_ts=second_per_grid_ts, tokens_per_second=tokens_per_second,
                              split_frames=True)

    def video_tokens(self, grid_thw, *, merge_size: int, special: Mapping[str, int],
                     group_seconds: Callable[[], Sequence[float]], encode: Callable[[str], Sequence[int]]) -> np.ndarray:
        _, gh, gw = grid_thw
        per_group = gh * gw // merge_size**2
        pieces = []
        for seconds in group_seconds():
            pieces.append(np.asarray(encode(timestamp_text(seconds)), dtype=np.int32))
            pieces.append(np.asarray([special["vision_start"]], dtype=np.int32))
            pieces.append(np.full(per_group, special["video_pad"], dtype=np.int32))
            pieces.append(np.asarray([special["vision_end"]], dtype=np.int32))
        return np.concatenate(pieces)

    def video_token_count(self, grid_thw, *, merge_size: int, group_seconds: Callable[[], Sequence[float]],
                          encode: Callable[[str], Sequence[int]], limit: int) -> int:
        grid_t, gh, gw = grid_thw
        pads = grid_t * (gh * gw // merge_size**2)
        if grid_t > limit:  # too long already: spare tokenizing grid_t timestamps (each takes a token at least)
            return pads + 3 * grid_t
        return pads + sum(len(encode(timestamp_text(seconds))) + 2 for seconds in group_seconds())

    def video_spans(self, input_ids: np.ndarray, special: Mapping[str, int]) -> list[tuple[int, int]]:
        """Everything between a video's outer `<|vision_start|>` and `<|vision_end|>` (each group's
        timestamp, inner markers and pads): a video ends where an inner `<|vision_end|>` is
        followed by the outer one."""
        starts, ends = token_runs(input_ids == special["video_pad"])
        vs, ve, n = special["vision_start"], special["vision_end"], len(input_ids)
        markers = np.flatnonzero(input_ids == vs)
        spans, first = [], None
        for a, b in zip(starts.tolist(), ends.tolist()):
            if first is None:
                outer = markers[markers < a - 1]
                first = int(outer[-1]) + 1 if len(outer) else a
            if b + 1 < n and input_ids[b] == ve and input_ids[b + 1] == ve:
                spans.append((first, b + 1))
                first = None
        return spans

    def video_layout_problem(self, input_ids: np.ndarray, video_grid_thw: np.ndarray, special: Mapping[str, int | None],
                             decode: Callable[[list[int]], str] | None) -> str | None:
        """Every group needs its timestamp text, made of plain tokens, right after the previous
        marker; decoded, it must read `<t.t seconds>`, and a video's timestamps never go back in
        time."""
        ids, grids = input_ids, video_grid_thw
        pad, vs, ve = special["video_pad"], special["vision_start"], special["vision_end"]
        is_pad = ids == pad
        starts = np.flatnonzero(is_pad & ~np.concatenate([[False], is_pad[:-1]]))  # one run per group (positions checked)
        markers = np.flatnonzero((ids == vs) | (ids == ve))
        if len(starts) != int(grids[:, 0].sum()) or (starts < 2).any() or (ids[starts - 1] != vs).any():
            return "a video group's pads do not follow <|vision_start|>"
        before = markers[np.searchsorted(markers, starts - 1) - 1]  # the marker ahead of each timestamp
        specials = np.asarray(sorted(v for v in special.values() if v is not None))
        texts = []
        for g, (b, start) in enumerate(zip(before.tolist(), starts.tolist())):
            span = ids[b + 1 : start - 1]
            if len(span) == 0 or np.isin(span, specials).any():
                return f"video group {g} has no timestamp text before its <|vision_start|> (tokens {span.tolist()})"
            texts.append(span)
        if decode is None:
            return None
        seconds = []
        for g, span in enumerate(texts):
            text = decode(span.tolist())
            match = TIMESTAMP_TEXT.fullmatch(text)
            if match is None:
                return f"video group {g}: timestamp text {text!r} is not '<t.t seconds>'"
            seconds.append(float(match.group(1)))
        first = 0
        for v, groups in enumerate(grids[:, 0].tolist()):
            times = seconds[first : first + groups]
            if any(b < a for a, b in zip(times, times[1:])):
                return f"video {v}: timestamps {times[:8]}{' ...' if len(times) > 8 else ''} go back in time"
            first += groups
        return None

    def bundled_tokenizer_json(self, qwen3_tokenizer_json: str) -> str:
        return qwen3_tokenizer_json


RULES = Qwen3VLRules()
