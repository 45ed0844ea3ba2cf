"""`shards_schema.positions.mrope_position_ids` == HF `get_rope_index` (the oracle) for both
families, on randomized image/text layouts; plus the error contract and output format."""

import numpy as np
import pytest

from shards_schema.positions import mrope_position_ids, text_position_ids
from tests.helpers.models import (
    IMAGE_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    hf_rope_index,
    tiny_qwen2_5_vl,
    tiny_qwen3_vl,
)

MERGE = 2
N_RANDOM = 200
SIDES = np.arange(2, 41, 2)  # grid h, w in patches; even so they merge 2x2


@pytest.fixture(scope="module")
def hf_models():
    return {"qwen3-vl": tiny_qwen3_vl(), "qwen2.5-vl": tiny_qwen2_5_vl()}


def random_sample(rng, t_choices=(1,), sides=SIDES):
    """Text runs (ids below the specials) around 0-4 images with random grids.

    Usually each image is wrapped in vision_start/end as the chat template does (so two
    images can be separated by only those two tokens); sometimes the wrappers are left out
    so pads sit at the very start or end of the row. Pad runs of different images never touch.
    """
    k = int(rng.integers(0, 5))
    wrap = rng.random() < 0.8
    parts, grids = [], []
    for i in range(k + 1):
        n = 0 if rng.random() < 0.4 else int(rng.integers(1, 60))
        if 0 < i < k and not wrap:
            n = max(n, 1)
        parts.append(rng.integers(0, 151643, n))
        if i < k:
            grid = (int(rng.choice(t_choices)), int(rng.choice(sides)), int(rng.choice(sides)))
            grids.append(grid)
            pads = [IMAGE_TOKEN_ID] * (grid[0] * grid[1] * grid[2] // MERGE**2)
            parts.append([VISION_START_TOKEN_ID, *pads, VISION_END_TOKEN_ID] if wrap else pads)
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    if ids.size == 0:
        ids = rng.integers(0, 151643, 1)
    return ids, np.asarray(grids, dtype=np.int64).reshape(-1, 3)


def ours(ids, grids):
    return mrope_position_ids(ids, grids, image_pad_id=IMAGE_TOKEN_ID, merge_size=MERGE)


@pytest.mark.parametrize(
    "t_choices, sides, n",
    [((1,), SIDES, N_RANDOM), ((1, 2, 3, 4), (2, 4, 6), 60)],
    ids=["images", "t>1"],  # t>1 never comes from the image processor; small sides make t > h/m, w/m
)
def test_matches_hf_get_rope_index(hf_models, t_choices, sides, n):
    """Exact equality with both families (so the two HF image rules agree with each other)."""
    rng = np.random.default_rng(1234 + len(t_choices))
    n_images = 0
    for i in range(n):
        ids, grids = random_sample(rng, t_choices, sides)
        n_images += len(grids)
        got = ours(ids, grids)
        expected = {name: hf_rope_index(m, ids, grids, IMAGE_TOKEN_ID) for name, m in hf_models.items()}
        for name, exp in expected.items():
            assert np.array_equal(got, exp), f"{name}, sample {i}: grids {grids.tolist()}, L={ids.size}"
    assert n_images > n  # the generator really produces images


def test_known_layout():
    """Spelled out: 2 text, image grid (1, 4, 6) -> merged 2 x 3, 1 text, image (1, 2, 2) at the end."""
    P = IMAGE_TOKEN_ID
    ids = np.array([7, 8] + [P] * 6 + [9] + [P])
    got = ours(ids, [[1, 4, 6], [1, 2, 2]])
    # image 1 starts at cur=2, then cur += max(2, 3) -> 5; text at 5, cur 6; image 2 at 6
    assert got.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


@pytest.mark.parametrize("grids", [None, np.zeros((0, 3), dtype=np.int64), []])
def test_text_only_is_arange(grids):
    ids = np.arange(100, 137)
    got = mrope_position_ids(ids, grids, image_pad_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    assert np.array_equal(got, np.tile(np.arange(37), (3, 1)))
    assert np.array_equal(got, text_position_ids(37))


def test_output_format():
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids, grids = random_sample(rng)
        for arr in (ids, ids.astype(np.int32)):
            got = ours(arr, grids)
            assert got.dtype == np.int32 and got.shape == (3, ids.size) and got.flags.c_contiguous
    empty = ours(np.zeros(0, dtype=np.int32), None)
    assert empty.shape == (3, 0) and empty.dtype == np.int32
    t = text_position_ids(5)
    assert t.dtype == np.int32 and t.shape == (3, 5) and t.flags.c_contiguous


P = IMAGE_TOKEN_ID
S, E = VISION_START_TOKEN_ID, VISION_END_TOKEN_ID


@pytest.mark.parametrize(
    "ids, grids, match",
    [
        ([1, S, P, E, 2], [], "1 image-pad runs .* 0 image grids"),
        ([1, 2, 3], [[1, 2, 2]], "0 image-pad runs .* 1 image grids"),
        ([S, P, E, S, P, E], [[1, 2, 2]], "2 image-pad runs .* 1 image grids"),
        ([S, P, P, E], [[1, 2, 2], [1, 2, 2]], "1 image-pad runs .* 2 image grids"),  # touching pads
        ([S, P, P, P, E], [[1, 4, 2]], "image 0: pad run of 3 tokens .* needs 2"),
        ([S, P, E, S] + [P] * 5 + [E], [[1, 2, 2], [1, 4, 4]], "image 1: pad run of 5 tokens .* needs 4"),
        ([S, P, E], [[1, 2, 3]], "divisible by merge_size"),
        ([S, P, E], [[0, 2, 2]], "positive"),
        ([S, P, E], [1, 2, 2], r"shape \[K, 3\]"),
        ([[S, P, E]], [[1, 2, 2]], "1-D"),
    ],
)
def test_mismatch_raises(ids, grids, match):
    with pytest.raises(ValueError, match=match):
        ours(np.asarray(ids), np.asarray(grids))
