"""Model families in the shard contract: the rules that both the writer (`preprocess`) and the
checker (`verify`, `show`) of a family's shards follow, each stated once, in one module per
family (`qwen3_vl.py`, `qwen2_5_vl.py`, `qwen3_5.py`).

A family's rules object holds:

* its video position rule (`video_positions`): whether each temporal group of a video is its
  own M-RoPE run, and the temporal position unit;
* the layout of a video's tokens in `input_ids` (`video_tokens`, `video_token_count`), how to
  find each video's tokens again (`video_spans`) and the check of the layout from ids alone
  (`video_layout_problem`);
* the variant of the bundled Qwen tokenizer it uses (`bundled_tokenizer_json`).

`RULES` maps the name a manifest records (`profile.family`) to the rules object. Only numpy and
`shards_schema.positions` are imported: `preprocess` builds on these rules, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from ..positions import VideoPositions
from . import qwen2_5_vl, qwen3_5, qwen3_vl

__all__ = ["FAMILY_NAMES", "RULES", "FamilyRules", "find_rules", "reading_rules", "rules_for"]


class FamilyRules(Protocol):
    """The interface of a family's rules object (one per module, e.g. `qwen3_vl.RULES`).

    `special` arguments map the names of `preprocess.profiles.SPECIAL_TOKEN_TEXT`
    ("video_pad", "vision_start", "vision_end", ...) to token ids, as a manifest records them.
    """

    name: str  # the family's name as profiles and manifests record it: "qwen3-vl"

    def video_positions(self, *, video_pad_id: int, video_grid_thw: np.ndarray, second_per_grid_ts: np.ndarray,
                        tokens_per_second: int) -> VideoPositions:
        """What a sample's videos add to `mrope_position_ids`: one run per video or per temporal
        group, and how far the temporal position moves per group."""
        ...

    def video_tokens(self, grid_thw: Sequence[int], *, merge_size: int, special: Mapping[str, int],
                     group_seconds: Callable[[], Sequence[float]],
                     encode: Callable[[str], Sequence[int]]) -> np.ndarray:
        """The int32 tokens that stand for one video (grid (t, h, w) in patches) in place of its
        single `<|video_pad|>`, inside the template's own vision markers. `group_seconds()` gives
        each temporal group's time and `encode(text)` a text's token ids; only layouts that write
        text call them."""
        ...

    def video_token_count(self, grid_thw: Sequence[int], *, merge_size: int,
                          group_seconds: Callable[[], Sequence[float]], encode: Callable[[str], Sequence[int]],
                          limit: int) -> int:
        """`len(video_tokens(...))`, counted without building the tokens: exact when the video has
        at most `limit` temporal groups, else a lower bound that is over `limit` too."""
        ...

    def video_spans(self, input_ids: np.ndarray, special: Mapping[str, int]) -> list[tuple[int, int]]:
        """[start, stop) of each video's tokens (those `video_tokens` writes) in a sample."""
        ...

    def video_layout_problem(self, input_ids: np.ndarray, video_grid_thw: np.ndarray, special: Mapping[str, int | None],
                             decode: Callable[[list[int]], str] | None) -> str | None:
        """What is wrong with the layout of a sample's video tokens beyond the pad runs (which the
        positions check covers), or None. `decode(ids)` reads text written by the layout (None:
        the sample's tokenizer is not at hand; checks that need the text are skipped)."""
        ...

    def bundled_tokenizer_json(self, qwen3_tokenizer_json: str) -> str:
        """The family's tokenizer, from the bundled Qwen3 tokenizer's serialized JSON."""
        ...


# Adding a family: its module here, and its rules in this tuple (docs/families.md).
RULES: dict[str, FamilyRules] = {rules.name: rules for rules in (qwen3_vl.RULES, qwen2_5_vl.RULES, qwen3_5.RULES)}
FAMILY_NAMES = tuple(RULES)


def rules_for(name: str) -> FamilyRules:
    """The rules of family `name`; ValueError for a name that is not a family."""
    rules = RULES.get(name)
    if rules is None:
        raise ValueError(f"unknown family {name!r}; choose one of {FAMILY_NAMES}")
    return rules


def find_rules(name) -> FamilyRules | None:
    """The rules of family `name`, or None."""
    return RULES.get(name)


def reading_rules(name) -> FamilyRules:
    """The rules to read a manifest's shards by. A family this version does not know (a manifest
    from another tool or version) is read with the plainest layout: pads only, one M-RoPE run per
    video, nothing further to check (`qwen2_5_vl.RULES`, which `VideoPositions` defaults to)."""
    return RULES.get(name, qwen2_5_vl.RULES)
