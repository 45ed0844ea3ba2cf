"""Qwen2.5-VL's rules of the shard contract (Qwen2-VL checkpoints follow them too).

A video is its pads alone: t*h*w/m^2 `<|video_pad|>` tokens in place of the template's one, as
HF's `Qwen2_5_VLProcessor` writes it. `get_rope_index` makes the whole video one vision run whose
temporal position moves `tokens_per_second * second_per_grid_t` per temporal group (float32,
truncated toward zero: `shards_schema.positions`). The tokenizer is the bundled Qwen3 one without
Qwen3's added tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..positions import VideoPositions, token_runs

# Added tokens that exist in the Qwen3 tokenizer but not in Qwen2/2.5's (same BPE otherwise).
QWEN3_ONLY_ADDED_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")


def qwen2_tokenizer_json(qwen3_tokenizer_json: str) -> str:
    """The Qwen2/2.5 tokenizer: the same BPE as Qwen3 without Qwen3's four added tokens."""
    spec = json.loads(qwen3_tokenizer_json)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in QWEN3_ONLY_ADDED_TOKENS]
    return json.dumps(spec, ensure_ascii=False)


class Qwen2_5VLRules:
    """Qwen2.5-VL: a video is one vision run of pads, timed by `second_per_grid_ts`."""

    name = "qwen2.5-vl"

    def video_positions(self, *, video_pad_id, video_grid_thw, second_per_grid_ts, tokens_per_second) -> VideoPositions:
        return VideoPositions(video_pad_id=video_pad_id, video_grid_thw=video_grid_thw,
                              second_per_grid_ts=second_per_grid_ts, tokens_per_second=tokens_per_second,
                              split_frames=False)

    def video_tokens(self, grid_thw, *, merge_size: int, special: Mapping[str, int],
                     group_seconds: Callable[[], Sequence[float]], encode: Callable[[str], Sequence[int]]) -> np.ndarray:
        grid_t, gh, gw = grid_thw
        return np.full(grid_t * (gh * gw // merge_size**2), special["video_pad"], dtype=np.int32)

    def video_token_count(self, grid_thw, *, merge_size: int, group_seconds: Callable[[], Sequence[float]],
                          encode: Callable[[str], Sequence[int]], limit: int) -> int:
        grid_t, gh, gw = grid_thw
        return grid_t * (gh * gw // merge_size**2)

    def video_spans(self, input_ids: np.ndarray, special: Mapping[str, int]) -> list[tuple[int, int]]:
        """Each video's pad run."""
        starts, ends = token_runs(input_ids == special["video_pad"])
        return list(zip(starts.tolist(), ends.tolist()))

    def video_layout_problem(self, input_ids: np.ndarray, video_grid_thw: np.ndarray, special: Mapping[str, int | None],
                             decode: Callable[[list[int]], str] | None) -> str | None:
        return None  # the pads are the whole layout; the positions check matches each run to its grid

    def bundled_tokenizer_json(self, qwen3_tokenizer_json: str) -> str:
        return qwen2_tokenizer_json(qwen3_tokenizer_json)


RULES = Qwen2_5VLRules()
