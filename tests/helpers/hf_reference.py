"""Hugging Face references: one conversation as HF's own processing makes it, and HF layouts
of the same samples a pack holds, which the oracle tests and the training-speed baseline feed
to HF models.

HF models shift labels internally, so both layouts carry *unshifted* labels (labels[i] =
input_ids[i] where the shard's loss_mask[i] == 1, else -100), unlike `assemble_pack`'s
shifted ones (see `train.packed_batch`).
"""

from __future__ import annotations

import numpy as np

from tests.helpers.models import hf_rope_index
from train.packed_batch import (
    DEFAULT_PAD_TOKEN_ID,
    IGNORE_INDEX,
    check_first_tokens,
    concat_field,
    sample_lengths,
    segment_offsets,
)

DEFAULT_IMAGE_PAD_ID = 151655  # <|image_pad|> for Qwen2.5-VL / Qwen3-VL
DEFAULT_VIDEO_PAD_ID = 151656  # <|video_pad|>


def hf_packed_position_ids(samples: list[dict]) -> np.ndarray:
    """Hugging Face's packed-sequence position ids, int64 [4, 1, T] (no padding).

    Row 0 = 1-D text positions restarting at 0 per sample (HF derives the packed attention
    segments from it), rows 1-3 = each sample's M-RoPE (t, h, w) rows, concatenated. With only
    three rows HF treats the pack as one sequence and samples attend to each other.
    """
    lengths = sample_lengths(samples)
    _, text = segment_offsets(lengths)
    mrope = np.concatenate([np.asarray(s["position_ids"]).reshape(3, -1) for s in samples], axis=1)
    return np.concatenate([text[None, :], mrope.astype(np.int64)], axis=0)[:, None, :]


def hf_packed_inputs(samples: list[dict], *, image_pad_id: int = DEFAULT_IMAGE_PAD_ID) -> dict:
    """The same samples as one packed HF batch of size 1 (for oracle tests against HF models).

    input_ids int64 [1, T]; position_ids int64 [4, 1, T] (`hf_packed_position_ids`);
    labels int64 [1, T] in HF's *unshifted* convention (labels[i] = input_ids[i] where the
    shard's loss_mask[i] == 1, else -100; the model shifts, and the shift never creates a
    cross-sample target because a sample's first token is never a target);
    mm_token_type_ids int64 [1, T] (1 on `image_pad_id`); pixel_patches uint8 [sum N, W];
    image_grid_thw int64 [sum K, 3]. Call with attention_mask=None, use_cache=False.
    """
    lengths = sample_lengths(samples)
    ids = concat_field(samples, "input_ids", np.int64)
    mask = concat_field(samples, "loss_mask", np.uint8)
    check_first_tokens(mask, lengths, samples)
    width = np.asarray(samples[0]["pixel_patches"]).shape[-1]
    return {
        "input_ids": ids[None, :],
        "position_ids": hf_packed_position_ids(samples),
        "labels": np.where(mask.astype(bool), ids, IGNORE_INDEX)[None, :],
        "mm_token_type_ids": (ids == image_pad_id).astype(np.int64)[None, :],
        "pixel_patches": concat_field(samples, "pixel_patches", np.uint8, width),
        "image_grid_thw": concat_field(samples, "image_grid_thw", np.int64, 3),
    }


def to_padded_batch(
    samples: list[dict],
    *,
    pad_token_id: int = DEFAULT_PAD_TOKEN_ID,
    image_pad_id: int = DEFAULT_IMAGE_PAD_ID,
    video_pad_id: int = DEFAULT_VIDEO_PAD_ID,
) -> dict:
    """BSHD layout (one row per sample, right padding) for debugging and HF comparisons.

    input_ids int64 [B, Lmax] (padding = `pad_token_id`); attention_mask int64 [B, Lmax];
    labels int64 [B, Lmax] in HF's *unshifted* convention (labels[b, i] = input_ids[b, i]
    where the shard's loss_mask is 1, else -100; HF shifts inside the model);
    position_ids int64 [3, B, Lmax] (padding = 1, as HF's `get_rope_index` leaves it);
    mm_token_type_ids int64 [B, Lmax] (1 on image pads, 2 on video pads); pixel_patches uint8
    [sum N, W], image_grid_thw int64 [sum K, 3], video_patches uint8 [sum M, 2W],
    video_grid_thw int64 [sum V, 3] and second_per_grid_ts float32 [sum V] concatenated in
    sample order.
    """
    if not samples:
        raise ValueError("to_padded_batch needs at least one sample")
    lengths = sample_lengths(samples)
    batch, lmax = len(samples), int(lengths.max())
    _, within = segment_offsets(lengths)
    rows = np.repeat(np.arange(batch), lengths)
    ids = concat_field(samples, "input_ids", np.int64)
    mask = concat_field(samples, "loss_mask", np.uint8)
    check_first_tokens(mask, lengths, samples)
    positions = np.concatenate([np.asarray(s["position_ids"]).reshape(3, -1) for s in samples], axis=1)

    input_ids = np.full((batch, lmax), pad_token_id, dtype=np.int64)
    input_ids[rows, within] = ids
    attention_mask = np.zeros((batch, lmax), dtype=np.int64)
    attention_mask[rows, within] = 1
    labels = np.full((batch, lmax), IGNORE_INDEX, dtype=np.int64)
    labels[rows, within] = np.where(mask.astype(bool), ids, IGNORE_INDEX)
    position_ids = np.ones((3, batch, lmax), dtype=np.int64)
    position_ids[:, rows, within] = positions
    width = np.asarray(samples[0]["pixel_patches"]).shape[-1]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "position_ids": position_ids,
        "mm_token_type_ids": ((input_ids == image_pad_id) + 2 * (input_ids == video_pad_id)).astype(np.int64)
        * attention_mask,
        "pixel_patches": concat_field(samples, "pixel_patches", np.uint8, width),
        "image_grid_thw": concat_field(samples, "image_grid_thw", np.int64, 3),
        "video_patches": concat_field(samples, "video_patches", np.uint8, 2 * width),
        "video_grid_thw": concat_field(samples, "video_grid_thw", np.int64, 3),
        "second_per_grid_ts": concat_field([{"s": np.asarray(s.get("second_per_grid_ts", []), np.float32)}
                                            for s in samples], "s", np.float32),
    }


def hf_sample(family, messages, tools, hf_images, tokenizer, template, image_processor, model):
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    if hf_images:
        features = image_processor(images=hf_images, return_tensors="np")
        pixel_values, grid = features["pixel_values"], features["image_grid_thw"]
    else:
        pixel_values, grid = np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64)
    merge = image_processor.merge_size
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(grid) + 1
    expanded = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // merge**2) + p for g, p in zip(grid, pieces[1:]))
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    positions = hf_rope_index(model, ids, grid)
    return ids, positions, pixel_values, grid

